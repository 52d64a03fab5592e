"""The EAGLE proposer in the engine: lossless output, exact logprobs, features, file format, refusal."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch
from helpers import engines
from helpers.checkpoints import teacher_forced_logits, write_tiny_checkpoint
from helpers.drafters import make_head

from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import DrafterError, EagleConfig, build_draft_vocab, eagle3_feature_layers
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.sampler import processed_logprobs
from specroll.protocol.sampling import SamplingParams

PAGE, K = 8, 4


make_engine = functools.partial(engines.make_engine, num_draft_tokens=K)  # every engine here drafts up to K tokens


def eagle(head: EagleHead) -> EagleProposer:
    return EagleProposer(head, page_size=PAGE, kv_cache_memory_gb=0.01)


def prompts_at_page_boundaries() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [PAGE * m - j for m in (2, 3) for j in range(K + 1)]  # page_size·m − j, j = 0..k
    shared = torch.randint(3, 300, (PAGE,), generator=g).tolist()  # a common first page, as a system prompt
    return [shared + torch.randint(3, 300, (n - PAGE,), generator=g).tolist() for n in lengths]


def run(engine: Engine, prompts: list[list[int]], sampling: SamplingParams, n: int = 1):
    for i, p in enumerate(prompts):
        for j in range(n):
            engine.add_request(p, sampling, f"r{i}.{j}", group_id=f"g{i}")
    return run_to_completion(engine)


@pytest.mark.parametrize("architecture", ["eagle3", "eagle"])
@pytest.mark.parametrize("taps", ["last", "eagle3"])
def test_greedy_eagle_equals_greedy_plain_and_frees_everything(tiny_checkpoint, taps, architecture):
    path = tiny_checkpoint("llama")
    config = load_checkpoint(str(path)).config
    prompts = prompts_at_page_boundaries()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = run(make_engine(path), prompts, greedy, n=2)
    engine = make_engine(path, eagle(make_head(config, taps, architecture=architecture)))
    spec = run(engine, prompts, greedy, n=2)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids for r, c in plain.items()}
    for r, c in spec.items():
        assert c.logprobs == pytest.approx(plain[r].logprobs, abs=1e-4)
    stats = engine.spec_stats
    # Every decode step but the last of each request drafted: group siblings and requests sharing
    # the first page (taken from the target's prefix cache) got their prompt features from the cache.
    assert stats.num_draft_steps == sum(len(c.token_ids) - 2 for c in spec.values())
    assert stats.num_drafted > stats.num_accepted
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer)
    assert not proposer._states and proposer.block_manager.num_free_pages == proposer.block_manager.num_pages
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("architecture", ["eagle3", "eagle"])
def test_sampled_eagle_drafts_keep_exact_logprobs_and_get_accepted(tiny_checkpoint, architecture):
    path = tiny_checkpoint("qwen3")
    config = load_checkpoint(str(path)).config
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=24, seed=5, ignore_eos=True)
    prompts = prompts_at_page_boundaries()[:4]
    head = make_head(config, "eagle3", draft_vocab=config.vocab_size, architecture=architecture)
    engine = make_engine(path, eagle(head))
    done = run(engine, prompts, sampling)
    assert engine.spec_stats.num_accepted > 0  # sampled q close to a flat p: many drafts pass
    reference = make_engine(path)
    for i, p in enumerate(prompts):
        c = done[f"r{i}.0"]
        logits = teacher_forced_logits(reference, p, c.token_ids)
        expected = processed_logprobs(logits, [sampling] * len(c.token_ids))
        expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-4


class RecordingProposer:
    """Drafts a fixed guess and records every feature update (a test implementation of the protocol)."""

    def __init__(self, feature_layers: tuple[int, ...]) -> None:
        self.feature_layers = feature_layers
        self.features: dict[str, dict[int, torch.Tensor]] = {}

    def attach(self, target) -> None:
        pass

    def propose(self, batch, k):
        from specroll.engine.spec.proposer import Proposal

        # Repeat the last token: sometimes right, so acceptances and rejections both happen.
        drafts = torch.tensor([[seq.token_ids[-1]] * k for seq in batch], dtype=torch.long)
        return Proposal(drafts, torch.full((len(batch),), k, dtype=torch.long), None)

    def observe(self, updates) -> None:
        for u in updates:
            rows = self.features.setdefault(u.request_id, {})
            for i in range(u.features.shape[0]):
                rows[u.start + i] = u.features[i].clone()

    def finish(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("layers", [(2,), (0, 1, 2)])
def test_observed_features_are_the_target_taps_of_every_verified_position(tiny_checkpoint, layers):
    path = tiny_checkpoint("llama")
    proposer = RecordingProposer(layers)
    engine = make_engine(path, proposer, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = prompts_at_page_boundaries()[::3]  # chunked prefill: 16-token budget
    done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert engine.spec_stats.num_accepted > 0 and engine.spec_stats.num_drafted > engine.spec_stats.num_accepted
    from specroll.engine.batch import build_metadata

    for i, p in enumerate(prompts):
        tokens = p + done[f"r{i}.0"].token_ids
        ids = torch.tensor(tokens[:-1])  # positions whose K/V the target verified before the end
        meta = build_metadata([len(ids)], [len(ids)], [list(range(8))], PAGE)
        engine.backend.plan(meta)
        _, taps = engine.model(ids, meta.positions(), engine.kv_caches, engine.backend, layers)
        seen = proposer.features[f"r{i}.0"]
        # Every position from 0 on, up to the last step's (a finished request gets no update).
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= len(tokens) - K - 2
        got = torch.stack([seen[t] for t in sorted(seen)])
        torch.testing.assert_close(got, taps[: len(seen)], atol=1e-4, rtol=1e-4)


def test_eagle_survives_preemption_with_identical_greedy_output(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    config = load_checkpoint(str(path)).config
    prompts = prompts_at_page_boundaries()
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(make_engine(path), prompts, greedy)
    small = dict(kv_cache_memory_gb=30 * PAGE * config.kv_bytes_per_token * 4 / 2**30, max_model_len=96)
    engine = make_engine(path, eagle(make_head(config)), **small)
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer)
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy, f"r{i}.0", group_id=f"g{i}")
    spec = {}
    while engine.has_unfinished():
        for out in engine.step():
            spec.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in engine.scheduler.running:  # the drafter's features follow the target's K/V
            state = proposer._states.get(seq.request_id)
            if state is not None and state.usable:
                assert state.num_features == seq.num_computed_tokens
                assert len(state.block_table) == proposer.block_manager.pages_needed(state.num_computed_tokens)
    assert engine.scheduler.num_preemptions > 0
    assert spec == {r: c.token_ids for r, c in plain.items()}
    assert engine.spec_stats.num_draft_steps > 0
    assert not proposer._states and proposer.block_manager.num_free_pages == proposer.block_manager.num_pages


@pytest.mark.parametrize("architecture", ["eagle3", "eagle"])
def test_save_load_round_trip_gives_the_same_drafts(tiny_checkpoint, tmp_path, architecture):
    path = tiny_checkpoint("llama")
    config = load_checkpoint(str(path)).config
    head = make_head(config, "eagle3", seed=3, architecture=architecture)
    head.save(tmp_path / "drafter")
    loaded = EagleHead.load(tmp_path / "drafter")
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    sampling = SamplingParams(temperature=0.9, max_tokens=12, seed=1, ignore_eos=True)
    prompts = prompts_at_page_boundaries()[:3]
    first = run(make_engine(path, eagle(head)), prompts, sampling)
    again = make_engine(path, EagleProposer(tmp_path / "drafter", page_size=PAGE, kv_cache_memory_gb=0.01))
    second = run(again, prompts, sampling)
    assert {r: c.token_ids for r, c in first.items()} == {r: c.token_ids for r, c in second.items()}


def test_a_drafter_for_another_vocabulary_or_hidden_size_is_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    other_vocab = tiny_checkpoint("qwen2", vocab_size=400)
    other_width = tiny_checkpoint("qwen3", hidden_size=96)
    other_depth = tmp_path / "deeper"
    other_depth.mkdir()
    write_tiny_checkpoint(other_depth, "llama", num_hidden_layers=3)
    for other, words in [(other_vocab, "vocabulary 400"), (other_width, "hidden size 96"), (other_depth, "3 layers")]:
        head = make_head(load_checkpoint(str(other)).config)
        drafter = tmp_path / f"drafter-{other.name}"
        head.save(drafter)
        with pytest.raises(DrafterError, match=words) as info:
            Engine(EngineConfig(model=str(path), page_size=PAGE, kv_cache_memory_gb=0.01, dtype="float32"),
                   proposer=EagleProposer(drafter, page_size=PAGE))
        assert str(drafter) in str(info.value) and "320" in str(info.value)


def test_malformed_drafter_files_are_refused_naming_the_file(tiny_checkpoint, tmp_path):
    config = load_checkpoint(str(tiny_checkpoint("llama"))).config
    good = tmp_path / "good"
    make_head(config).save(good)
    cases = {}
    (missing := tmp_path / "missing").mkdir()
    cases[missing] = "config.json not found"
    bad_json = tmp_path / "bad_json"
    make_head(config).save(bad_json)
    (bad_json / "config.json").write_text("{not json")
    cases[bad_json] = "config.json"
    bad_field = tmp_path / "bad_field"
    make_head(config).save(bad_field)
    raw = json.loads((bad_field / "config.json").read_text())
    (bad_field / "config.json").write_text(json.dumps({**raw, "draft_vocab_size": 0}))
    cases[bad_field] = "draft_vocab_size=0"
    unknown_field = tmp_path / "unknown_field"
    make_head(config).save(unknown_field)
    (unknown_field / "config.json").write_text('{"x": 1}')  # JSON, but not a drafter's config
    cases[unknown_field] = r"unknown field `x`; expected a drafter config as 'specroll init-drafter'"
    wrong_shape = tmp_path / "wrong_shape"
    make_head(config).save(wrong_shape)
    (wrong_shape / "config.json").write_text(json.dumps({**raw, "intermediate_size": 64}))
    cases[wrong_shape] = r"layer.mlp.gate_up_proj.weight has shape \(256, 64\), its config makes it \(128, 64\)"
    non_finite = tmp_path / "non_finite"
    head = make_head(config)
    assert head.lm_head is not None
    with torch.no_grad():
        head.lm_head.weight[0, 0] = float("inf")
    head.save(non_finite)
    cases[non_finite] = "lm_head.weight holds NaN or infinite values"
    float_ids = tmp_path / "float_ids"
    make_head(config).save(float_ids)
    from safetensors.torch import load_file, save_file

    tensors = load_file(float_ids / "model.safetensors")
    save_file({**tensors, "draft_to_target": tensors["draft_to_target"].float()}, float_ids / "model.safetensors")
    cases[float_ids] = "draft_to_target has dtype torch.float32, expected integer"
    cases[tmp_path / "nowhere"] = "does not exist"
    not_tensors = tmp_path / "not_tensors"
    make_head(config).save(not_tensors)
    (not_tensors / "model.safetensors").write_bytes(b"\x00" * 100)
    cases[not_tensors] = "safetensors"
    for where in cases:  # edited by hand: a folder without checksums, as one written by hand is
        (where / "checksums.json").unlink(missing_ok=True)
    tampered = tmp_path / "tampered"  # with its checksums: changed after specroll wrote it
    make_head(config).save(tampered)
    raw_weights = bytearray((tampered / "model.safetensors").read_bytes())
    raw_weights[-1] ^= 0x01
    (tampered / "model.safetensors").write_bytes(bytes(raw_weights))
    cases[tampered] = re.escape(f"drafter {tampered / 'model.safetensors'}: SHA-256 ")
    cut_short = tmp_path / "cut_short"
    make_head(config).save(cut_short)
    os.truncate(cut_short / "model.safetensors", 1000)
    cases[cut_short] = re.escape(f"drafter {cut_short / 'model.safetensors'}: 1000 bytes, checksums.json says ")
    for where, words in cases.items():
        with pytest.raises(DrafterError, match=words):
            EagleHead.load(where)
    EagleHead.load(good)


def test_a_weight_update_reaches_the_drafters_lm_head(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # tied: the LM head is the embedding
    config = load_checkpoint(str(path)).config
    engine = make_engine(path, eagle(make_head(config, architecture="eagle")))  # "eagle" drafts through the target's
    proposer = engine.proposer
    assert isinstance(proposer, EagleProposer)
    new = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(5))
    engine.update_weights({"model.embed_tokens.weight": new}, version=1)
    torch.testing.assert_close(proposer._head_weight, new[proposer.head.draft_to_target])
    engine.add_request(prompts_at_page_boundaries()[0], SamplingParams(temperature=0.0, max_tokens=6), "r")
    done = run_to_completion(engine)["r"]
    assert done.versions == [1] * 6 and engine.spec_stats.num_drafted > 0


def test_a_drafter_file_without_an_architecture_is_an_eagle_head_and_a_bad_one_is_named(tiny_checkpoint, tmp_path):
    config = load_checkpoint(str(tiny_checkpoint("llama"))).config
    old = tmp_path / "old"
    make_head(config, architecture="eagle").save(old)
    raw = json.loads((old / "config.json").read_text())
    assert raw["architecture"] == "eagle"
    del raw["architecture"]  # as every drafter written before the field existed (and before checksums)
    (old / "config.json").write_text(json.dumps(raw))
    (old / "checksums.json").unlink()
    loaded = EagleHead.load(old)
    assert loaded.config.architecture == "eagle" and loaded.lm_head is None and loaded.fuse is None
    (old / "config.json").write_text(json.dumps({**raw, "architecture": "medusa"}))
    with pytest.raises(DrafterError, match=r"architecture='medusa', expected 'eagle3' .* or 'eagle'"):
        EagleHead.load(old)
    new = tmp_path / "new"
    make_head(config, "eagle3", architecture="eagle3").save(new)
    assert json.loads((new / "config.json").read_text())["architecture"] == "eagle3"
    # eagle3 files carry the head's own LM head; an eagle one's tensors do not fit its config
    (old / "config.json").write_text(json.dumps({**raw, "architecture": "eagle3"}))
    with pytest.raises(DrafterError, match="missing tensors"):
        EagleHead.load(old)


def test_an_eagle3_head_drafts_through_its_own_lm_head_initialised_from_the_target(tiny_checkpoint):
    ckpt = load_checkpoint(str(tiny_checkpoint("llama")))
    config = ckpt.config
    d2t = build_draft_vocab(torch.arange(config.vocab_size, 0, -1).float(), 64)
    rows = ckpt.weights["model.embed_tokens.weight"][d2t]  # tied: the LM head is the embedding
    head = EagleHead.init(EagleConfig.for_target(config, eagle3_feature_layers(config.num_layers), 64), d2t,
                          lm_head=rows)
    assert head.config.architecture == "eagle3" and head.lm_head is not None
    assert torch.equal(head.lm_head.weight, rows)
    hidden = torch.randn(5, config.hidden_size)
    expected = torch.nn.functional.linear(head.norm(hidden), rows).float()
    torch.testing.assert_close(head.draft_logits(hidden, torch.zeros(64, config.hidden_size)), expected)
    torch.testing.assert_close(head.draft_logits(hidden), expected)
    with pytest.raises(ValueError, match="must ascend"):
        EagleHead(head.config, d2t.flip(0))
    with pytest.raises(ValueError, match="has none of its own"):
        EagleHead.init(EagleConfig.for_target(config, (2,), 64, "eagle"), d2t, lm_head=rows)
