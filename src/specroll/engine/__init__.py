"""The synchronous generation core: model, paged KV cache, scheduler, sampler, engine."""
