"""The sides ``bench_generate.py`` measures specroll's engine against, on the same prompt token ids
and sampling (T = 1, no top-k or top-p filter): transformers' ``generate()`` on a model built from
specroll's :class:`~specroll.engine.model_config.ModelConfig`, and llama.cpp on the same GGUF file
(a reference column, when ``llama-cpp-python`` is installed). Each returns ``(useful tokens,
seconds)``: tokens up to and including each response's first EOS."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from specroll.engine.loaders.checkpoint import Checkpoint


def build_hf_model(checkpoint: Checkpoint, source: Path, dtype: torch.dtype) -> PreTrainedModel:
    """A transformers model with ``checkpoint.config``'s hyper-parameters and SDPA attention.

    Weights: transformers' own dequantization for a GGUF file (what ``from_pretrained(gguf_file=)``
    runs, minus accelerate); for a Hugging Face directory, the safetensors tensors as loaded.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    c = checkpoint.config
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[c.architecture]
    eos = c.eos_token_ids[0] if c.eos_token_ids else None
    config = config_class(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=eos, pad_token_id=eos, attn_implementation="sdpa",
    )
    model = model_class(config)
    if source.is_file() and source.suffix == ".gguf":
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        weights = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model,
                                       torch_dtype=torch.float32)["tensors"]
    else:
        weights = checkpoint.weights
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = ["lm_head.weight"] if c.tie_word_embeddings else []
    if missing != allowed_missing or unexpected:
        raise RuntimeError(f"transformers model from {source}: missing {missing}, unexpected {unexpected}")
    assert model.config._attn_implementation == "sdpa"
    return model.to(dtype).eval()


def run_hf(model: PreTrainedModel, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
           eos_token_ids: list[int], seed: int) -> tuple[int, float]:
    """``generate()`` over ``prompts`` in left-padded chunks of ``batch_size``; returns (useful
    tokens, seconds). A row's useful tokens end at its first EOS, inclusive."""
    import torch
    from tqdm import tqdm
    from transformers.generation.streamers import BaseStreamer

    pad = eos_token_ids[0]
    eos = torch.tensor(eos_token_ids)
    chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    # left padding: the last prompt token of every row sits in the last column
    batches = []
    for chunk in chunks:
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # [b, width]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])  # [b, width]
        batches.append((input_ids, attention_mask))

    class StepBar(BaseStreamer):
        """Advances a progress bar once per decode step (generate() first puts the prompt)."""

        def __init__(self, bar: tqdm) -> None:
            self.bar, self.seen_prompt = bar, False

        def put(self, value: torch.Tensor) -> None:
            if self.seen_prompt:
                self.bar.update(1)
            self.seen_prompt = True

        def end(self) -> None:
            self.seen_prompt = False

    useful = 0
    torch.manual_seed(seed)
    with tqdm(total=len(chunks) * max_new_tokens, unit="step", desc=f"transformers B={batch_size}",
              dynamic_ncols=True) as bar:
        streamer = StepBar(bar)
        start = time.perf_counter()
        for input_ids, attention_mask in batches:
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids, pad_token_id=pad,
                streamer=streamer,
            )
            generated = out[:, input_ids.shape[1] :]  # [b, steps]; EOS-padded after a row finishes
            is_eos = torch.isin(generated, eos)
            first_eos = is_eos.int().argmax(dim=1)
            useful += int(torch.where(is_eos.any(dim=1), first_eos + 1, generated.shape[1]).sum())
        elapsed = time.perf_counter() - start
    return useful, elapsed


def run_llama_cpp(path: Path, prompts: list[list[int]], max_new_tokens: int, eos_token_ids: list[int], seed: int,
                  threads: int) -> tuple[int, float]:
    """``llama_cpp.Llama.generate`` over ``prompts`` one at a time; returns (useful tokens, seconds).
    A response ends at its first EOS (counted) or after ``max_new_tokens``."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, seed=seed,
                verbose=False)
    eos = set(eos_token_ids)

    def one(prompt: list[int]) -> int:
        n = 0
        for token in llm.generate(prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if token in eos or n >= max_new_tokens:
                break
        return n

    one(prompts[0][:8])  # warm-up: first-call costs
    start = time.perf_counter()
    useful = sum(one(prompt) for prompt in prompts)
    return useful, time.perf_counter() - start


def llama_cpp_problem(source: Path) -> str | None:
    """Why the llama.cpp column cannot run here, or None."""
    if source.suffix != ".gguf":
        return f"{source} is not a GGUF file"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None
