"""``Engine.update_weights``: a bad update is refused whole and changes nothing; a good one makes the
engine generate exactly what a fresh engine on the new weights generates, tagged with the new version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.engines import make_engine

from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import Checkpoint, load_checkpoint
from specroll.protocol.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PAGE = 8


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, PAGE * 2 + 3, PAGE * 3)]


def generate(engine: Engine, batch: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens and versions for each prompt."""
    for i, p in enumerate(batch):
        engine.add_request(p, GREEDY, f"r{i}")
    done = run_to_completion(engine)
    return [done[f"r{i}"].token_ids for i in range(len(batch))], [done[f"r{i}"].versions for i in range(len(batch))]


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """Two tiny Llama checkpoints of one architecture with different random weights."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_tiny_checkpoint(first, "llama", seed=0, tie_word_embeddings=False)
    write_tiny_checkpoint(second, "llama", seed=1, tie_word_embeddings=False)
    return first, second


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.model.state_dict().items()}


def assert_same_parameters(engine: Engine, reference: Engine) -> None:
    """Every parameter (whatever the engine's internal layout) equals the reference engine's."""
    ours, theirs = engine.model.state_dict(), reference.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def assert_unchanged(engine: Engine, weights: dict[str, torch.Tensor], tokens: list[list[int]], version: int) -> None:
    assert engine.weight_version == version
    now = engine.model.state_dict()
    changed = [name for name, t in weights.items() if not torch.equal(now[name], t)]
    assert not changed, f"a refused update changed {changed}"
    again, versions = generate(engine, prompts())
    assert again == tokens
    assert all(v == [version] * len(t) for v, t in zip(versions, again, strict=True))


@pytest.mark.parametrize(("bad", "match"), [
    ({"model.layers.0.self_attn.q_proj.weight_typo": torch.zeros(64, 64)},
     r"'model\.layers\.0\.self_attn\.q_proj\.weight_typo'"),
    ({"lm_head.bias": torch.zeros(320)}, r"unknown tensor 'lm_head\.bias'"),
    # The engine's own fused parameter is not a checkpoint name.
    ({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(128, 64)}, r"unknown tensor 'model\.layers\.0\."),
    # (64,) would broadcast into the [320, 64] embedding if the shape were not checked.
    ({"model.embed_tokens.weight": torch.zeros(64)},
     r"model\.embed_tokens\.weight has shape \(64,\), expected \(320, 64\)"),
    ({"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 128)},
     r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(64, 128\), expected \(128, 64\)"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.int64)}, r"model\.norm\.weight has dtype torch\.int64"),
    ({"model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bool)},
     r"model\.layers\.0\.input_layernorm\.weight has dtype torch\.bool"),
])
def test_bad_tensor_is_refused_and_changes_nothing(two_checkpoints, bad: dict[str, torch.Tensor], match: str) -> None:
    engine = make_engine(two_checkpoints[0])
    tokens, _ = generate(engine, prompts())
    weights = snapshot(engine)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(bad, version=1)
    assert_unchanged(engine, weights, tokens, 0)


def test_stale_version_is_refused_and_changes_nothing(two_checkpoints) -> None:
    first, second = two_checkpoints
    engine = make_engine(first)
    new = load_checkpoint(second).weights
    with pytest.raises(ValueError, match=r"weight version 0 is not newer than the served version 0"):
        engine.update_weights(new, version=0)
    with pytest.raises(ValueError, match=r"weight version -1 is not newer"):
        engine.update_weights(new, version=-1)
    engine.update_weights({"model.norm.weight": torch.full((64,), 1.5)}, version=3)
    tokens, _ = generate(engine, prompts())
    weights = snapshot(engine)
    for stale in (3, 2):
        with pytest.raises(ValueError, match=rf"weight version {stale} is not newer than the served version 3"):
            engine.update_weights(new, version=stale)
    assert_unchanged(engine, weights, tokens, 3)


@pytest.mark.parametrize("last", [
    ("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 65)),
    ("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 64, dtype=torch.int32)),
    ("model.layers.9.self_attn.o_proj.weight", torch.zeros(64, 64)),
])
def test_update_whose_last_tensor_is_bad_changes_none_of_the_others(two_checkpoints, last) -> None:
    first, second = two_checkpoints
    engine = make_engine(first)
    tokens, _ = generate(engine, prompts())
    weights = snapshot(engine)
    update = dict(load_checkpoint(second).weights)  # every tensor valid and different from the served ones
    update.pop(last[0], None)
    update[last[0]] = last[1]  # inserted last: validated after all the good ones
    assert list(update)[-1] == last[0]
    with pytest.raises(ValueError, match=last[0].replace(".", r"\.")):
        engine.update_weights(update, version=1)
    assert_unchanged(engine, weights, tokens, 0)


def test_full_update_generates_like_a_fresh_engine(two_checkpoints) -> None:
    first, second = two_checkpoints
    fresh_tokens, fresh_versions = generate(make_engine(second), prompts())
    engine = make_engine(first)
    old_tokens, _ = generate(engine, prompts())  # also fills the prefix cache under version 0
    assert old_tokens != fresh_tokens
    engine.update_weights(load_checkpoint(second).weights, version=7)
    assert engine.weight_version == 7
    tokens, versions = generate(engine, prompts())
    assert tokens == fresh_tokens
    assert versions == [[7] * len(t) for t in tokens]
    assert fresh_versions == [[0] * len(t) for t in tokens]


def test_bf16_update_is_cast_to_the_engine_dtype(two_checkpoints) -> None:
    first, second = two_checkpoints
    target = load_checkpoint(second)
    bf16 = {name: t.to(torch.bfloat16) for name, t in target.weights.items()}
    rounded = {name: t.float() for name, t in bf16.items()}  # what a float32 engine must hold
    reference = make_engine(second, checkpoint=Checkpoint(target.config, rounded, target.tokenizer, "bf16"))
    expected_tokens, _ = generate(reference, prompts())
    engine = make_engine(first)
    engine.update_weights(bf16, version=1)
    assert_same_parameters(engine, reference)
    tokens, versions = generate(engine, prompts())
    assert tokens == expected_tokens
    assert versions == [[1] * len(t) for t in tokens]


def test_partial_update_replaces_only_the_named_tensors(two_checkpoints) -> None:
    # Single projections that the engine may store fused with others (q/k/v, gate/up): updating one
    # must leave its neighbours alone.
    first, second = two_checkpoints
    served, new = load_checkpoint(first), load_checkpoint(second)
    named = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
             "model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"]
    merged = dict(served.weights) | {n: new.weights[n] for n in named}
    reference = make_engine(first, checkpoint=Checkpoint(served.config, merged, served.tokenizer, "merged"))
    expected_tokens, _ = generate(reference, prompts())
    engine = make_engine(first)
    engine.update_weights({n: new.weights[n] for n in named}, version=1)
    assert_same_parameters(engine, reference)
    assert generate(engine, prompts())[0] == expected_tokens
    assert expected_tokens != generate(make_engine(first), prompts())[0]


def test_request_after_an_update_does_not_reuse_old_kv(two_checkpoints) -> None:
    # A prompt whose full pages were computed (and cached) under version 0 is recomputed under the
    # new weights, even while the request that computed them is still running.
    first, second = two_checkpoints
    prompt = prompts()[2]
    fresh = generate(make_engine(second), [prompt])[0][0]
    engine = make_engine(first)
    engine.add_request(prompt, GREEDY, "old")
    (out,) = engine.step()  # prefill: the prompt's full pages are now keyed in the prefix cache
    assert out.new_versions == [0]
    engine.update_weights(load_checkpoint(second).weights, version=1)
    engine.add_request(prompt, GREEDY, "new")
    done = run_to_completion(engine)
    assert done["new"].token_ids == fresh and done["new"].versions == [1] * len(fresh)
    # run_to_completion includes the token streamed before the update, which keeps its version.
    assert done["old"].versions == [0] + [1] * (GREEDY.max_tokens - 1)


def test_pages_computed_across_an_update_are_never_shared(two_checkpoints) -> None:
    # A chunked prefill that straddles the update fills its first page with K/V from both versions;
    # that page must not be served from the prefix cache to a request under the new weights.
    first, second = two_checkpoints
    prompt = prompts()[2]
    fresh = generate(make_engine(second), [prompt])[0][0]
    config = EngineConfig(model=str(first), page_size=PAGE, kv_cache_memory_gb=0.01, max_model_len=256,
                          max_num_batched_tokens=PAGE // 2, dtype="float32")
    engine = Engine(config)
    # A short request decodes alongside, so every step samples something.
    engine.add_request([5, 6], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), "companion")
    engine.add_request(prompt, GREEDY, "straddling")
    engine.step()  # the companion's prompt and the first 2 tokens of the straddling one, under version 0
    engine.update_weights(load_checkpoint(second).weights, version=1)
    while not any(out.request_id == "straddling" for out in engine.step()):
        pass  # the rest of the prompt, under version 1
    engine.add_request(prompt, GREEDY, "new")
    done = run_to_completion(engine)
    assert done["new"].token_ids == fresh
