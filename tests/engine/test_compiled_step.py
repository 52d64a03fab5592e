"""The compiled decoder layer (``engine/compiled_step.py``) and the packed bf16 matmuls
(``engine/cpu_linear.py``): the same tokens and logprobs as eager steps, across the batch sizes a run
shrinks through, after a weight update, and from a second process that loads the compiled code from
the disk cache instead of compiling it.

Compiling from scratch costs ~30 CPU-s (Inductor's C++ builds); the module does it once, in the
``first_compile`` fixture, whose disk cache the second process loads. Later engines of this process
reuse what it compiled (Dynamo's and Inductor's in-memory caches), as any later engine of a run would."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import engines
from helpers.checkpoints import write_tiny_checkpoint
from helpers.engines import K, k_drafts, repetitive_prompts, run
from helpers.timeouts import guard

from specroll.engine import cpu_linear
from specroll.engine.compiled_step import CompileCacheError, CompileCounters
from specroll.engine.config import EngineConfig
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.protocol.sampling import SamplingParams

make_engine = functools.partial(engines.make_engine, num_draft_tokens=K, max_num_seqs=8)


def other_checkpoint(tmp_path: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """Another tiny checkpoint of the same shapes: its folder and its weights (Hugging Face names)."""
    path = tmp_path / f"other-{seed}"
    write_tiny_checkpoint(path, seed=seed)
    return path, dict(load_checkpoint(path).weights)


def compiled(path: Path, cache: Path, proposer=None, **settings: object):
    return make_engine(path, proposer, compile="on", compile_cache_dir=str(cache), **settings)


@dataclass(frozen=True)
class FirstCompile:
    cache: Path
    """The compile cache folder it wrote (and the module's other compiled engines share)."""
    tokens: dict
    """``run`` of ``repetitive_prompts(3)`` at temperature 0, through JSON (as the second process prints it)."""
    misses: int
    hits: int
    """FX-graph cache misses and hits of its compile."""


@pytest.fixture(scope="module")
def first_compile(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstCompile:
    """``tiny_llama``'s layers compiled from scratch — Dynamo's cache of this process cleared, a fresh cache
    folder — by the engine the second process builds (``CHILD``), which then runs three prompts."""
    torch._dynamo.reset()
    cache = tmp_path_factory.mktemp("compile-cache")
    before = CompileCounters.read()
    engine = engines.make_engine(tiny_llama, compile="on", compile_cache_dir=str(cache), max_num_seqs=4)
    tokens = run(engine, repetitive_prompts(3), 0.0)
    after = CompileCounters.read()
    return FirstCompile(cache, json.loads(json.dumps(tokens)), after.cache_misses - before.cache_misses,
                        after.cache_hits - before.cache_hits)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_steps_emit_what_eager_steps_emit(tiny_checkpoint, first_compile, speculative: bool,
                                                  temperature: float):
    # prefill chunks, decodes of 7 shrinking to 1 sequence (T = 1 and T > 1 graphs) and verifies of K drafts
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(7)
    eager = run(make_engine(path, k_drafts(speculative)), prompts, temperature)
    engine = compiled(path, first_compile.cache, k_drafts(speculative))
    out = run(engine, prompts, temperature)
    assert {r: t for r, (t, _) in out.items()} == {r: t for r, (t, _) in eager.items()}
    for r, (_, logprobs) in out.items():
        assert logprobs == pytest.approx(eager[r][1], abs=1e-5)
    assert engine.runner.layers.compile_seconds > 0  # the layers did run compiled
    if speculative and temperature == 0.0:
        assert engine.spec_stats.num_accepted > 0


def test_batch_sizes_across_a_graph_bucket_boundary(tiny_checkpoint, first_compile):
    # 17 sequences finishing one by one: steps of 17, 16 and 15 decodes, padded to the buckets 17 and
    # 16 of the graph path (which shares the compiled layer), against eager unpadded steps
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(17, seed=3)

    def by_length(engine):
        for i, prompt in enumerate(prompts):
            params = dict(temperature=1.0, max_tokens=3 + i, ignore_eos=True, seed=7 + i)
            engine.add_request(prompt, SamplingParams(**params), f"r{i}")
        sizes, out = [], {}
        while engine.has_unfinished():
            sizes.append(engine.num_live_requests)
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return sizes, out

    _, eager = by_length(make_engine(path, max_num_seqs=17))
    engine = compiled(path, first_compile.cache, max_num_seqs=17, cuda_graphs="emulate")
    sizes, out = by_length(engine)
    assert {17, 16, 15} <= set(sizes) and out == eager
    assert {(17, 1), (16, 1)} <= set(engine.runner.graphs.captured())


def test_a_weight_update_reaches_the_compiled_layers(tiny_checkpoint, tmp_path, first_compile):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(4)
    engine = compiled(path, first_compile.cache)
    before = run(engine, prompts, 0.0)
    other, new = other_checkpoint(tmp_path, 11)
    engine.update_weights(new, version=1)
    after = run(engine, prompts, 0.0)
    expected = run(make_engine(other), prompts, 0.0)  # an engine that started with the new weights
    assert {r: t for r, (t, _) in after.items()} == {r: t for r, (t, _) in expected.items()} != {
        r: t for r, (t, _) in before.items()}
    for r, (_, logprobs) in after.items():
        assert logprobs == pytest.approx(expected[r][1], abs=1e-5)


CPU_PROBLEM = cpu_linear.packing_problem(torch.device("cpu"), torch.bfloat16)
"""Why this CPU packs no bf16 weight (an AVX2-only one), or None."""


@pytest.mark.skipif(CPU_PROBLEM is not None, reason=str(CPU_PROBLEM))
def test_packed_matmuls_multiply_as_linear_and_follow_updates(tiny_checkpoint, tmp_path):
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    cpu_linear.pack(weight)
    assert torch.equal(cpu_linear.linear(x, weight, bias), F.linear(x, weight, bias))
    with torch.no_grad():
        weight.mul_(-2)
    assert not torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))  # the packed copy is a copy
    cpu_linear.repack(weight)
    assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))

    # an engine in bf16 packs its matmul weights and packs them again on a weight update
    path = tiny_checkpoint("llama")
    engine = make_engine(path, dtype="bfloat16")
    assert engine.runner.packed_bytes == sum(w.numel() * 2 for w in engine.model.matmul_weights()) > 0
    other, new = other_checkpoint(tmp_path, 5)
    engine.update_weights(new, version=1)
    prompts = repetitive_prompts(3)
    assert run(engine, prompts, 0.0) == run(make_engine(other, dtype="bfloat16"), prompts, 0.0)


def test_float32_and_a_cpu_without_the_packed_path_pack_nothing(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    assert make_engine(path).runner.packed_bytes == 0  # float32: the reference path
    problem = cpu_linear.packing_problem(torch.device("cpu"), torch.float32)
    assert problem == "the dtype is float32 (packing is for bfloat16)"
    if CPU_PROBLEM is not None:  # this CPU (AVX2 only): a bf16 engine runs F.linear instead of failing to pack
        assert CPU_PROBLEM.startswith("this CPU has no oneDNN bf16 packed linear")
        engine = make_engine(path, dtype="bfloat16")
        assert engine.runner.packed_bytes == 0 and run(engine, repetitive_prompts(2), 0.0)


def test_compile_settings_are_checked(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="compile='yes', expected one of 'off', 'on'"):
        EngineConfig(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pack_weights='maybe', expected true or false"):
        EngineConfig(pack_weights="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile_cache_dir='', expected a directory path or None"):
        EngineConfig(compile_cache_dir="")
    taken = tmp_path / "a-file"
    taken.write_text("")
    for where, why in ((taken, "cannot be created"), (taken / "sub", "cannot be created")):
        with pytest.raises(CompileCacheError, match=f"compile_cache_dir='{where}' {why}"):
            make_engine(tiny_llama, compile="on", compile_cache_dir=str(where))


CHILD = """
import json, sys
from helpers import engines
from helpers.engines import repetitive_prompts, run
from specroll.engine.compiled_step import CompileCounters
engine = engines.make_engine(sys.argv[1], compile="on", compile_cache_dir=sys.argv[2], max_num_seqs=4)
tokens = run(engine, repetitive_prompts(3), 0.0)
print(json.dumps({"counters": CompileCounters.read().__dict__, "tokens": tokens}))
"""


@pytest.mark.integration
def test_a_second_process_loads_the_compiled_code_from_the_cache(tiny_llama, first_compile):
    env_path = str(Path(__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama), str(first_compile.cache)],
                          capture_output=True, text=True, timeout=guard(600), env={**_env(), "PYTHONPATH": env_path})
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert (first_compile.misses, first_compile.hits) == (2, 0)  # T = 1 and T > 1, compiled and written
    assert second["counters"]["cache_hits"] == 2 and second["counters"]["cache_misses"] == 0
    assert second["tokens"] == first_compile.tokens


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}


def test_compiled_layers_tap_the_features_a_drafter_reads(tiny_checkpoint, first_compile):
    # EAGLE-3 taps residual streams inside the stack (and EAGLE-1 the final hidden state): the compiled
    # stack returns the same taps as the eager one
    from specroll.engine.batch import build_metadata

    path = tiny_checkpoint("llama")
    ids = torch.tensor(repetitive_prompts(1)[0])
    out = []
    for engine in (make_engine(path), compiled(path, first_compile.cache)):
        meta = build_metadata([len(ids)], [len(ids)], [list(range(4))], engine.config.page_size)
        engine.backend.plan(meta)
        runner = engine.runner
        out.append(runner.model(ids, meta.positions(), runner.kv_caches, runner.backend, (2, 0, 1), runner.layers))
    (eager_hidden, eager_taps), (hidden, taps) = out
    assert taps.shape == (len(ids), 3 * 64)
    torch.testing.assert_close(taps, eager_taps, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden, eager_hidden, atol=1e-5, rtol=0)
