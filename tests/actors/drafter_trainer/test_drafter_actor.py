"""Online drafter training end to end: a RolloutClient in the test, a generator process speculating
with ``eagle``, and a drafter-trainer process (``python -m specroll.actors.drafter_trainer.cli``), all on a
tiny random checkpoint over real sockets. Every process is killed and reaped on the way out."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.drafters import run_config
from helpers.processes import drafter_process, generator_process, wait_until

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig
from specroll.actors.drafter_trainer.actor import DrafterActor
from specroll.actors.rollout.client import RolloutClient
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig, eagle3_feature_layers
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.engine.checkpoint import load_checkpoint
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.model import CausalLM
from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import Capacity, PublishDrafter, RolloutChunk
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio

SAMPLING = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
HANG_S = 60.0
"""The clients' heartbeat timeout: a hang guard, so a starved generator is never declared dead."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


LONG_CONTEXT = 4096
"""Positions of the model whose long rollout must outlast two drafter swaps."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("drafter-actor") / "tiny"
    path.mkdir()
    write_tiny_checkpoint(path)
    return path


async def test_drafter_versions_reach_the_generator_and_survive_the_drafter_trainer(model, tmp_path):
    chunks: list[tuple[RolloutChunk, int]] = []
    client = RolloutClient(heartbeat_timeout_s=HANG_S)

    def on_chunk(actor: str, chunk: RolloutChunk) -> None:
        served = client.drafters.generator_drafters.get(actor, (0, ""))[0]
        chunks.append((chunk, served))

    client.on_chunk = on_chunk
    config = run_config(model, tmp_path / "run")
    async with client:
        with generator_process(client.endpoint, model, tmp_path / "gen.log", "--speculative", "eagle"), \
                drafter_process(client.endpoint, config, tmp_path / "drafter.log") as drafter:
            await client.wait_for_generators(1, timeout=60)
            await wait_until(lambda: client.drafters.drafters, 60, "the drafter trainer's Hello")
            prompts = [[5 + i, 17, 33, 2 * i + 40] for i in range(40)]
            for p in prompts[:8]:
                await client.submit(p, 2, SAMPLING)
            for _ in range(8):
                await client.next_finished(timeout=60)
            # the drafter trainer cold-starts from these rollouts and publishes; the generator serves it
            await wait_until(lambda: client.drafters.generator_drafters.get("gen-0", (0, ""))[0] >= 1, 120,
                             "the generator to serve drafter version 1")
            served, checksum = client.drafters.generator_drafters["gen-0"]
            assert checksum == client.drafters.published.checksum or client.drafters.published.version > served
            assert client.drafters.checksums_match()
            # chunks after the ack name the new version (the swap test below checks what they count)
            start = len(chunks)
            for p in prompts[8:16]:
                await client.submit(p, 2, SAMPLING)
            for _ in range(8):
                await client.next_finished(timeout=60)
            later = chunks[start:]
            assert all(c.spec is not None and c.spec.drafter_version >= v for c, v in later)
            assert any(c.spec.num_draft_steps > 0 and c.spec.drafter_version >= 1 for c, _ in later)
            assert any(d >= 1 for d, _ in client.drafters.acceptance())
            # a policy update reaches the drafter trainer, which acknowledges it
            target = CausalLM(load_checkpoint(str(model)).config)
            target.load_weights(load_checkpoint(str(model)).weights)
            await client.publish_weights(dict(target.hf_weights()), version=1, dtype="float32")
            await wait_until(lambda: client.drafter_policy_versions.get("drafter-0") == 1, 60,
                             "the drafter trainer to take policy version 1")
            await client.wait_for_version(1, timeout=60)
            # killing the drafter trainer stops neither generation nor the served drafter
            os.killpg(drafter.pid, signal.SIGKILL)
            drafter.wait(timeout=30)
            for p in prompts[16:24]:
                await client.submit(p, 2, SAMPLING)
            # gone once its connection closed and the client read all it had sent (a last PublishDrafter too)
            await wait_until(lambda: "drafter-0" not in client.drafters.drafters, 60,
                             "the client to declare the drafter trainer gone")
            # what it published before dying still reaches the generator; from then on nothing changes
            await wait_until(lambda: served_version(client) == client.drafters.published.version, 60,
                             "the generator to serve the last published version")
            before = client.drafters.generator_drafters["gen-0"]
            for _ in range(8):
                group = await client.next_finished(timeout=60)
                assert all(len(s.token_ids) == SAMPLING.max_tokens for s in group.samples)
            assert client.drafters.generator_drafters["gen-0"] == before
            # a restarted drafter trainer starts cold but numbers its versions above the published one;
            # cold (a run dir without a saved drafter): it can publish only after rollouts, which the
            # client sends behind the announcement of the published version, so it always knows it first
            published = client.drafters.published.version
            cold = run_config(model, tmp_path / "run2")
            with drafter_process(client.endpoint, cold, tmp_path / "drafter2.log"):
                await wait_until(lambda: "training against policy version 1" in (tmp_path / "drafter2.log").read_text(),
                                 60, "the restarted drafter trainer to join")
                for p in prompts[24:32]:
                    await client.submit(p, 2, SAMPLING)
                for _ in range(8):
                    await client.next_finished(timeout=60)
                await wait_until(lambda: served_version(client) > before[0], 120,
                                 f"the generator to serve a version above {before[0]} from the restarted trainer")
    log = (tmp_path / "drafter.log").read_text()
    assert "sent drafter version 1 to the trainer" in log, log[-2000:]
    restarted = (tmp_path / "drafter2.log").read_text()
    first = int(restarted.split("sent drafter version ", 1)[1].split()[0])
    assert first == published + 1 and "is not above the published" not in restarted, restarted[-2000:]


def publish_head(client: RolloutClient, head: EagleHead, version: int) -> None:
    """Publish ``head`` as drafter ``version`` through the client's relay (as a drafter trainer would)."""
    tensors = head.wire_tensors()
    refs, frames = pack_tensors(sorted(tensors.items()))
    msg = PublishDrafter(version=version, policy_version=0, config=msgspec.json.encode(head.config).decode(),
                         checksum=head_checksum(tensors), tensors=refs)
    client.drafters.on_publish("test", msg, {r.name: t for r, t in zip(refs, frames, strict=True)})
    client.drafters.announce_to(["gen-0"])


def served_version(client: RolloutClient) -> int:
    return client.drafters.generator_drafters.get("gen-0", (0, ""))[0]


async def test_a_drafter_for_another_target_is_refused_and_generation_goes_on(model, tmp_path):
    other = EagleConfig(target_vocab_size=999, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2,
                        head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, feature_layers=(2,), draft_vocab_size=64,
                        target_num_layers=2)
    async with RolloutClient(heartbeat_timeout_s=HANG_S) as client:
        with generator_process(client.endpoint, model, tmp_path / "gen.log", "--speculative", "eagle"):
            await client.wait_for_generators(1, timeout=60)
            publish_head(client, EagleHead.init(other, torch.arange(64)), 1)
            await wait_until(lambda: "gen-0" in client.drafters.refusals, 60, "the generator's refusal")
            assert "vocabulary 999, hidden size 32" in client.drafters.refusals["gen-0"]
            await client.submit([5, 6, 7], 2, SAMPLING)
            group = await client.next_finished(timeout=60)
            assert all(len(s.token_ids) == SAMPLING.max_tokens for s in group.samples)
            assert "gen-0" not in client.drafters.generator_drafters


async def test_a_drafter_swap_splits_live_samples_chunks_by_drafter_version(tmp_path):
    """Each chunk's draft counts come from the one drafter version it names: the generator sends every
    live sample's pending tokens before a swap. Chunks are only sent at a swap here (``--stream-every``
    huge). Drafter 2 has another shape, so it replaces the proposer and cannot draft for samples that
    began under drafter 1 (it never saw their features): their chunks after the swap draft nothing,
    those before it did. The live group's budget (thousands of tokens) keeps it running through both
    swaps however slowly the test process follows; drafter 3 flushes its drafter-2 tokens, then it is
    aborted."""
    model = tmp_path / "long"
    model.mkdir()
    write_tiny_checkpoint(model, max_position_embeddings=LONG_CONTEXT)
    cfg = load_checkpoint(str(model)).config
    layers = eagle3_feature_layers(cfg.num_layers)
    first = EagleHead.init(EagleConfig.for_target(cfg, layers, 64), torch.arange(64))
    second = EagleHead.init(EagleConfig.for_target(cfg, layers, 96), torch.arange(96))
    third = EagleHead.init(EagleConfig.for_target(cfg, layers, 96), torch.arange(96), seed=1)
    chunks: dict[tuple[str, int], list[RolloutChunk]] = {}
    client = RolloutClient(heartbeat_timeout_s=HANG_S)
    client.on_chunk = lambda actor, c: chunks.setdefault((c.group_id, c.sample_index), []).append(c)
    long = SamplingParams(temperature=1.0, max_tokens=LONG_CONTEXT - 8, ignore_eos=True)
    async with client:
        with generator_process(client.endpoint, model, tmp_path / "gen.log", "--speculative", "eagle",
                               "--stream-every", "1000000"):
            await client.wait_for_generators(1, timeout=60)
            publish_head(client, first, 1)
            await wait_until(lambda: served_version(client) == 1, 60, "the generator to serve drafter version 1")
            live = await client.submit([5, 17, 33], 2, long)
            await client.submit([6, 17, 33], 1, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
            await client.next_finished(timeout=60)  # the short group: the long one is mid-flight now
            publish_head(client, second, 2)
            await wait_until(lambda: served_version(client) == 2, 60, "the generator to serve drafter version 2")
            after = await client.submit([7, 17, 33], 1, SAMPLING)
            assert (await client.next_finished(timeout=120)).group_id == after
            publish_head(client, third, 3)  # the swap flushes the live samples' drafter-2 tokens before its ack
            await wait_until(lambda: served_version(client) == 3, 60, "the generator to serve drafter version 3")
            assert live in client.coordinator.groups, "the long group finished: it did not span the swaps"
            await client.abort(live)
    for i in range(2):
        spec = [c.spec for c in chunks[(live, i)]]
        versions = [(s.drafter_version, s.num_draft_steps) for s in spec if s is not None]
        assert versions[0][0] == 1 and versions[0][1] > 0, versions  # flushed at the swap
        assert versions[-1][0] == 2 and all(steps == 0 for v, steps in versions if v == 2), versions
    spec = [c.spec for c in chunks[(after, 0)]]
    assert all(s is not None and s.drafter_version == 2 for s in spec)
    assert sum(s.num_draft_steps for s in spec if s is not None) > 0


def test_a_policy_update_never_changes_the_drafters_bytes(model):
    """Engine.update_weights re-reads the LM-head rows but leaves the head's own tensors alone."""
    ckpt = load_checkpoint(str(model))
    head = EagleHead.init(EagleConfig.for_target(ckpt.config, (2,), 64), torch.arange(64))
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128),
                    proposer=EagleProposer(head, kv_cache_memory_gb=0.01))
    before = head_checksum(engine.proposer.head.wire_tensors())
    weights = {n: t + 0.01 for n, t in ckpt.weights.items()}
    engine.update_weights(weights, version=1)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), "r")
    run_to_completion(engine)
    assert head_checksum(engine.proposer.head.wire_tensors()) == before


def test_hot_swap_keeps_the_served_head_object_and_takes_the_new_bytes(model):
    ckpt = load_checkpoint(str(model))
    config = EagleConfig.for_target(ckpt.config, (2,), 64)
    proposer = EagleProposer(EagleHead.init(config, torch.arange(64), seed=0), kv_cache_memory_gb=0.01)
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128),
                    proposer=proposer)
    served = proposer.head
    new = EagleHead.init(config, torch.arange(64, 128), seed=1)
    proposer.load_head(new)
    assert proposer.head is served
    assert head_checksum(served.wire_tensors()) == head_checksum(new.wire_tensors())
    assert torch.equal(proposer._d2t.cpu(), torch.arange(64, 128))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), "r")
    assert len(run_to_completion(engine)["r"].token_ids) == 8


def test_learner_versions_checksums_and_policy_refresh(model):
    ckpt = load_checkpoint(str(model))
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


@pytest.mark.parametrize(("capacity", "below", "expected"), [
    (Capacity(live_seqs=0, max_seqs=0), 0.25, True),  # no load reported: idle
    (Capacity(live_seqs=2, max_seqs=16), 0.25, True),
    (Capacity(live_seqs=12, max_seqs=16), 0.25, False),  # busy: wait for the tail
    (Capacity(live_seqs=12, max_seqs=16), 1.0, True),
    (Capacity(live_seqs=0, max_seqs=16, pause=True), 1.0, False),  # asked to pause
])
def test_schedule_trains_on_idle_capacity_and_pauses_when_asked(model, capacity, below, expected):
    ckpt = load_checkpoint(str(model))
    target = CausalLM(ckpt.config)
    target.load_weights(ckpt.weights)
    learner = DrafterLearner(target, LearnerConfig(min_rollouts=1))
    learner.add_rollout([5, 6, 7, 8], 2)
    config = RunConfig(model=ModelSection(name=str(model)), drafter=DrafterConfig(train_below=below))
    actor = DrafterActor(config, learner, channel=None, connect="tcp://127.0.0.1:1",  # type: ignore[arg-type]
                         actor_id="drafter-0")
    actor.capacity = capacity
    assert actor.may_train() is expected


def test_a_drafter_attached_after_the_prefix_cache_is_warm_still_drafts(model):
    """Requests that share cached prompt pages with earlier ones get drafts from a drafter that
    arrived later (it never saw those pages' features; set_proposer restarts the prefix cache)."""
    ckpt = load_checkpoint(str(model))
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128,
                                 page_size=8))
    prompt = list(range(5, 30))  # three full pages shared by every request
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), "warm")
    run_to_completion(engine)
    head = EagleHead.init(EagleConfig.for_target(ckpt.config, (2,), 64), torch.arange(64))
    engine.set_proposer(EagleProposer(head, sample_drafts=False, kv_cache_memory_gb=0.01, page_size=8))
    engine.add_request([*prompt, 40], SamplingParams(temperature=0.0, max_tokens=8), "later")
    run_to_completion(engine)
    assert engine.spec_stats.num_draft_steps > 0


def test_a_fetch_overtaken_by_a_newer_drafter_version_is_answered_with_its_announcement_not_an_error():
    """A drafter trainer publishing faster than a fetch's round trip: the generator's fetch of version 2
    arrives after version 3 was published. Nothing is lost (version 3 is announced, and the generator
    fetches it), so it is no error; a version never published still is one."""
    from specroll.actors.rollout.drafter_relay import DrafterRelay
    from specroll.protocol.messages import DrafterAvailable, DrafterWeights, Error, FetchDrafter

    sent: list[tuple[str, object]] = []
    relay = DrafterRelay(lambda actor, msg, tensors: sent.append((actor, msg)))
    for version in (2, 3):
        relay.on_publish("drafter-0", PublishDrafter(version=version, policy_version=1, config="{}", checksum="c",
                                                     tensors=()), {})
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=2))
    assert [type(m) for _, m in sent] == [DrafterAvailable] and sent[0][1].version == 3
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=3))
    assert [type(m) for _, m in sent] == [DrafterWeights] and sent[0][1].version == 3
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=9))
    assert [type(m) for _, m in sent] == [Error, DrafterAvailable]
    assert "version 9 is not published" in sent[0][1].message


def test_acceptance_is_reported_per_version_and_a_drop_below_the_floor_warns(caplog):
    from specroll.actors.rollout.drafter_relay import DrafterRelay
    from specroll.protocol.messages import SpecStats

    relay = DrafterRelay(lambda actor, msg, tensors: None)

    def chunk(drafter: int, policy: int, accepted: int, steps: int) -> RolloutChunk:
        return RolloutChunk(group_id="g", sample_index=0, offset=0, token_ids=[1], logprobs=[0.0], versions=[policy],
                            spec=SpecStats(num_drafted=4 * steps, num_accepted=accepted, num_draft_steps=steps,
                                           drafter_version=drafter))

    relay.on_chunk(chunk(3, 7, 30, 10))
    relay.on_chunk(chunk(3, 8, 5, 10))
    with caplog.at_level("WARNING"):
        report = relay.report(floor=1.8)
    assert report["acceptance_by_version"] == [
        {"drafter_version": 3, "policy_version": 7, "acceptance_length": 4.0, "draft_steps": 10},
        {"drafter_version": 3, "policy_version": 8, "acceptance_length": 1.5, "draft_steps": 10},
    ]
    assert report["acceptance_length_window"] == 1 + 35 / 20
    assert report["acceptance_below_floor"] is True  # the newest policy version (8) is at 1.5 < 1.8
    assert "below the floor 1.80" in caplog.text
    warning = report["acceptance_floor_warning"]  # in the metrics line too: the launcher prints it
    assert "acceptance length 1.50 under policy version 8 is below the floor 1.80" in warning, warning
    relay.on_chunk(chunk(4, 8, 25, 10))
    report = relay.report(floor=1.8)  # only what arrived since the last report
    assert report["acceptance_by_version"] == [
        {"drafter_version": 4, "policy_version": 8, "acceptance_length": 3.5, "draft_steps": 10}]
    assert report["acceptance_below_floor"] is False and report["acceptance_floor_warning"] is None


async def test_a_drafter_trainer_for_another_model_exits_with_a_clear_error(model, tmp_path):
    """Started without the run's config (another model), it refuses the trainer's policy: exit 2."""
    other = tmp_path / "other"
    other.mkdir()
    write_tiny_checkpoint(other, hidden_size=32, intermediate_size=64)
    config = run_config(other, tmp_path / "run")
    target = CausalLM(load_checkpoint(str(model)).config)
    target.load_weights(load_checkpoint(str(model)).weights)
    async with RolloutClient(heartbeat_timeout_s=HANG_S) as client:
        await client.publish_weights(dict(target.hf_weights()), version=1, dtype="float32")
        with drafter_process(client.endpoint, config, tmp_path / "drafter.log") as drafter:
            await wait_until(lambda: drafter.poll() is not None, 60, "the drafter trainer to exit")
    log = (tmp_path / "drafter.log").read_text()
    assert drafter.returncode == 2, log[-2000:]
    assert "is not the model this drafter trainer loaded" in log and "--config RUN_DIR/config.toml" in log, log[-2000:]


def test_a_resumed_run_warm_starts_from_the_drafter_it_saved(model, tmp_path, caplog):
    from specroll.actors.drafter_trainer.actor import build_learner

    cfg = load_checkpoint(str(model)).config
    saved = EagleHead.init(EagleConfig.for_target(cfg, eagle3_feature_layers(cfg.num_layers), 64), torch.arange(64))
    saved.save(tmp_path / "drafter")
    config = RunConfig(run_dir=str(tmp_path), model=ModelSection(name=str(model)))  # saves to RUN_DIR/drafter
    learner = build_learner(config)
    assert learner.head is not None
    assert head_checksum(learner.head.wire_tensors()) == head_checksum(saved.wire_tensors())
    other = tmp_path / "other_run" / "drafter"  # a drafter saved for another model is ignored: cold start
    other_cfg = EagleConfig(target_vocab_size=999, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2,
                            head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, feature_layers=(1,), draft_vocab_size=64,
                            target_num_layers=2)
    EagleHead.init(other_cfg, torch.arange(64)).save(other)
    config = RunConfig(run_dir=str(tmp_path / "other_run"), model=ModelSection(name=str(model)),
                       drafter=DrafterConfig(draft_vocab_size=64))
    assert build_learner(config).head is None
    assert "starting cold" in caplog.text


def test_a_cold_start_draft_vocabulary_above_the_models_is_refused_not_capped(model, tmp_path, capsys):
    """``specroll drafter serve`` refuses what ``specroll launch`` refuses, naming the value and the limit."""
    from specroll.actors.drafter_trainer.actor import build_learner
    from specroll.actors.drafter_trainer.cli import serve
    from specroll.drafter.eagle_config import DrafterError

    config = RunConfig(run_dir=str(tmp_path), model=ModelSection(name=str(model)),
                       drafter=DrafterConfig(draft_vocab_size=321))  # the tiny model has 320 tokens
    with pytest.raises(DrafterError, match=r"drafter.draft_vocab_size=321 exceeds the vocabulary of .* \(320 "
                                           r"tokens\); expected at most 320"):
        build_learner(config)
    assert serve(config, "tcp://127.0.0.1:9") == 2  # before connecting: nothing waits for a trainer
    err = capsys.readouterr().err
    assert "specroll drafter serve: error: drafter.draft_vocab_size=321" in err, err
    assert build_learner(msgspec.structs.replace(config, drafter=DrafterConfig(draft_vocab_size=320))).head is None


def test_drafter_kv_cache_too_small_for_one_request_is_refused_at_start(model):
    """A generator drafting with ``eagle`` refuses a ``drafter.kv_cache_gb`` that cannot hold one
    request's head K/V (else every request would go undrafted, silently): at start, and when a
    drafter version of a new shape arrives."""
    from specroll.actors.config import GeneratorConfig
    from specroll.actors.generator.drafter_swap import DrafterSlot, ReadyDrafter
    from specroll.actors.generator.engine_build import build_engine
    from specroll.drafter.eagle_config import DrafterError

    def config(kv_cache_gb: float, trees: tuple[str, ...] = ("2x2:4",)) -> RunConfig:
        engine = EngineConfig(kv_cache_memory_gb=0.01, dtype="float32", page_size=16, max_model_len=256,
                              draft_trees=trees)
        return RunConfig(model=ModelSection(name=str(model)), generator=GeneratorConfig(
            speculative="eagle", engine=engine), drafter=DrafterConfig(enabled=True, kv_cache_gb=kv_cache_gb))

    # one layer, 2 KV heads x 16, float32: 256 bytes a position; 256 + 3 draft positions = 17 pages = 69632 bytes
    with pytest.raises(DrafterError, match=r"^drafter.kv_cache_gb=1e-05 holds the drafter's K/V for 32 positions, "
                                           r"fewer than one request needs: 256 tokens .* = 259; expected "
                                           r"drafter.kv_cache_gb >= 6.5e-05"):
        build_engine(config(1e-5))
    # a draft tree of depth 6 and width 4 steps the head through (6 - 1) * 4 rows past the last verified one
    with pytest.raises(DrafterError, match=r"256 tokens .* \+ 20 draft positions = 276;"):
        build_engine(config(6.5e-5, ("3x1:3", "6x4:16")))
    engine, counter = build_engine(config(6.5e-5))  # the least it names is enough
    assert counter is None  # a cold start: the first version arrives from the drafter trainer
    head = EagleHead.init(EagleConfig.for_target(engine.model_config, (2,), 64), torch.arange(64))
    ack = DrafterSlot(engine, None, kv_cache_memory_gb=1e-5).swap(ReadyDrafter(1, "c" * 64, head))
    assert "drafter.kv_cache_gb=1e-05" in ack.refused, ack
    assert not DrafterSlot(engine, None, kv_cache_memory_gb=6.5e-5).swap(ReadyDrafter(1, "c" * 64, head)).refused
