"""Run an engine until its queue is empty, assembling each request's deltas into a Completion."""

from __future__ import annotations

from collections.abc import Callable

from specroll.engine.engine import Engine
from specroll.engine.sequence import Completion, StepOutput


def run_to_completion(
    engine: Engine, on_step: Callable[[list[StepOutput]], None] | None = None
) -> dict[str, Completion]:
    """Step ``engine`` until every queued request has finished.

    Args:
        engine: an engine with requests queued.
        on_step: called with each step's outputs (progress bars, streaming).

    Returns:
        request id → its completion (response tokens, behavior logprobs, policy versions), tokens
        produced before the call included.
    """
    prompts = {rid: engine.prompt_token_ids(rid) for rid in engine.live_request_ids()}
    partial = {rid: engine.output_so_far(rid) for rid in prompts}
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            tokens, logprobs, versions = partial[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs)
            versions.extend(out.new_versions)
            if out.finished:
                assert out.finish_reason is not None
                done[out.request_id] = Completion(
                    out.request_id, out.group_id, prompts[out.request_id], tokens, logprobs, versions,
                    out.finish_reason,
                )
        if on_step is not None:
            on_step(outputs)
    return done
