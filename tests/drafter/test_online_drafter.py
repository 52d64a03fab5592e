"""The online drafter in one process, on a tiny random target: a learner's versions, checksums and
policy refresh, and a served EAGLE head across a policy update, a hot swap and a warm prefix cache."""

from __future__ import annotations

import torch

from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams


def test_a_policy_update_never_changes_the_drafters_bytes(tiny_llama):
    """Engine.update_weights re-reads the LM-head rows but leaves the head's own tensors alone."""
    ckpt = load_checkpoint(str(tiny_llama))
    head = EagleHead.init(EagleConfig.for_target(ckpt.config, (2,), 64), torch.arange(64))
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128),
                    proposer=EagleProposer(head, kv_cache_memory_gb=0.01))
    before = head_checksum(engine.proposer.head.wire_tensors())
    weights = {n: t + 0.01 for n, t in ckpt.weights.items()}
    engine.update_weights(weights, version=1)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), "r")
    run_to_completion(engine)
    assert head_checksum(engine.proposer.head.wire_tensors()) == before


def test_hot_swap_keeps_the_served_head_object_and_takes_the_new_bytes(tiny_llama):
    ckpt = load_checkpoint(str(tiny_llama))
    config = EagleConfig.for_target(ckpt.config, (2,), 64)
    proposer = EagleProposer(EagleHead.init(config, torch.arange(64), seed=0), kv_cache_memory_gb=0.01)
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128),
                    proposer=proposer)
    served = proposer.head
    new = EagleHead.init(config, torch.arange(64, 128), seed=1)
    proposer.load_head(new)
    assert proposer.head is served
    assert head_checksum(served.wire_tensors()) == head_checksum(new.wire_tensors())
    assert torch.equal(proposer._d2t.cpu(), torch.arange(64, 128))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), "r")
    assert len(run_to_completion(engine)["r"].token_ids) == 8


def test_learner_versions_checksums_and_policy_refresh(tiny_llama):
    ckpt = load_checkpoint(str(tiny_llama))
    target = CausalLM(ckpt.config)
    target.load_weights(ckpt.weights)
    learner = DrafterLearner(target, LearnerConfig(min_rollouts=2, batch=2, window=16, draft_vocab_size=32),
                             eos_token_ids=[2])
    assert not learner.ready
    learner.add_rollout([5, 6, 7, 8, 9, 10], 3)
    learner.add_rollout([5, 6, 11, 12, 13, 14], 3)
    assert learner.ready
    learner.step()
    first = learner.snapshot()
    assert (first.version, first.train_steps) == (1, 1)
    assert 2 in learner.head.draft_to_target.tolist()  # end of sequence is always draftable
    assert first.checksum == head_checksum(first.tensors)
    entries = list(learner._buffer)
    learner._refresh(entries, learner.head)
    cached = [e.features.clone() for e in entries]
    learner.set_policy({n: t * 1.5 for n, t in ckpt.weights.items()}, version=4)
    learner.step()
    second = learner.snapshot()
    assert (second.version, second.policy_version) == (2, 4)
    assert second.checksum != first.checksum
    learner._refresh(entries, learner.head)  # stale features are recomputed under the new policy
    assert all(e.policy_version == 4 and not torch.equal(e.features, c) for e, c in zip(entries, cached, strict=True))


def test_a_drafter_attached_after_the_prefix_cache_is_warm_still_drafts(tiny_llama):
    """Requests that share cached prompt pages with earlier ones get drafts from a drafter that
    arrived later (it never saw those pages' features; set_proposer restarts the prefix cache)."""
    ckpt = load_checkpoint(str(tiny_llama))
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128,
                                 page_size=8))
    prompt = list(range(5, 30))  # three full pages shared by every request
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), "warm")
    run_to_completion(engine)
    head = EagleHead.init(EagleConfig.for_target(ckpt.config, (2,), 64), torch.arange(64))
    engine.set_proposer(EagleProposer(head, sample_drafts=False, kv_cache_memory_gb=0.01, page_size=8))
    engine.add_request([*prompt, 40], SamplingParams(temperature=0.0, max_tokens=8), "later")
    run_to_completion(engine)
    assert engine.spec_stats.num_draft_steps > 0
