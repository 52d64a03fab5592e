"""Online drafter training end to end: a RolloutClient in the test, a generator process speculating
with ``eagle``, and a drafter-trainer process (``python -m specroll.actors.drafter_trainer.cli``), all on a
tiny random checkpoint over real sockets. Every process is killed and reaped on the way out. Then
the actor's training schedule and its warm or cold start (the learner and a served head in one
process: ``tests/drafter/test_online_drafter.py``; the relay: ``tests/actors/rollout/test_drafter_relay.py``)."""

from __future__ import annotations

import os
import signal

import msgspec
import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.drafters import run_config
from helpers.processes import drafter_process, generator_process, wait_until
from helpers.timeouts import guard

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig
from specroll.actors.drafter_trainer.actor import DrafterActor
from specroll.actors.rollout.client import RolloutClient
from specroll.drafter.eagle_config import EagleConfig, eagle3_feature_layers
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import Capacity, PublishDrafter, RolloutChunk
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio

SAMPLING = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
HANG_S = guard(60.0)
"""The clients' heartbeat timeout: a hang guard, so a starved generator is never declared dead."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


LONG_CONTEXT = 4096
"""Positions of the model whose long rollout must outlast two drafter swaps."""


@pytest.mark.integration
async def test_drafter_versions_reach_the_generator_and_survive_the_drafter_trainer(tiny_llama, tmp_path):
    chunks: list[tuple[RolloutChunk, int]] = []
    client = RolloutClient(heartbeat_timeout_s=HANG_S)

    def on_chunk(actor: str, chunk: RolloutChunk) -> None:
        served = client.drafters.generator_drafters.get(actor, (0, ""))[0]
        chunks.append((chunk, served))

    client.on_chunk = on_chunk
    config = run_config(tiny_llama, tmp_path / "run")
    async with client:
        with generator_process(client.endpoint, tiny_llama, tmp_path / "gen.log", "--speculative", "eagle"), \
                drafter_process(client.endpoint, config, tmp_path / "drafter.log") as drafter:
            await client.wait_for_generators(1, timeout=guard(60))
            await wait_until(lambda: client.drafters.drafters, guard(60), "the drafter trainer's Hello")
            prompts = [[5 + i, 17, 33, 2 * i + 40] for i in range(40)]
            for p in prompts[:8]:
                await client.submit(p, 2, SAMPLING)
            for _ in range(8):
                await client.next_finished(timeout=guard(60))
            # the drafter trainer cold-starts from these rollouts and publishes; the generator serves it
            await wait_until(lambda: client.drafters.generator_drafters.get("gen-0", (0, ""))[0] >= 1, guard(120),
                             "the generator to serve drafter version 1")
            served, checksum = client.drafters.generator_drafters["gen-0"]
            assert checksum == client.drafters.published.checksum or client.drafters.published.version > served
            assert client.drafters.checksums_match()
            # chunks after the ack name the new version (the swap test below checks what they count)
            start = len(chunks)
            for p in prompts[8:16]:
                await client.submit(p, 2, SAMPLING)
            for _ in range(8):
                await client.next_finished(timeout=guard(60))
            later = chunks[start:]
            assert all(c.spec is not None and c.spec.drafter_version >= v for c, v in later)
            assert any(c.spec.num_draft_steps > 0 and c.spec.drafter_version >= 1 for c, _ in later)
            assert any(d >= 1 for d, _ in client.drafters.acceptance())
            # a policy update reaches the drafter trainer, which acknowledges it
            target = CausalLM(load_checkpoint(str(tiny_llama)).config)
            target.load_weights(load_checkpoint(str(tiny_llama)).weights)
            await client.publish_weights(dict(target.hf_weights()), version=1, dtype="float32")
            await wait_until(lambda: client.drafter_policy_versions.get("drafter-0") == 1, guard(60),
                             "the drafter trainer to take policy version 1")
            await client.wait_for_version(1, timeout=guard(60))
            # killing the drafter trainer stops neither generation nor the served drafter
            os.killpg(drafter.pid, signal.SIGKILL)
            drafter.wait(timeout=guard(30))
            for p in prompts[16:24]:
                await client.submit(p, 2, SAMPLING)
            # gone once its connection closed and the client read all it had sent (a last PublishDrafter too)
            await wait_until(lambda: "drafter-0" not in client.drafters.drafters, guard(60),
                             "the client to declare the drafter trainer gone")
            # what it published before dying still reaches the generator; from then on nothing changes
            await wait_until(lambda: served_version(client) == client.drafters.published.version, guard(60),
                             "the generator to serve the last published version")
            before = client.drafters.generator_drafters["gen-0"]
            for _ in range(8):
                group = await client.next_finished(timeout=guard(60))
                assert all(len(s.token_ids) == SAMPLING.max_tokens for s in group.samples)
            assert client.drafters.generator_drafters["gen-0"] == before
            # a restarted drafter trainer starts cold but numbers its versions above the published one;
            # cold (a run dir without a saved drafter): it can publish only after rollouts, which the
            # client sends behind the announcement of the published version, so it always knows it first
            published = client.drafters.published.version
            cold = run_config(tiny_llama, tmp_path / "run2")
            with drafter_process(client.endpoint, cold, tmp_path / "drafter2.log"):
                await wait_until(lambda: "training against policy version 1" in (tmp_path / "drafter2.log").read_text(),
                                 guard(60), "the restarted drafter trainer to join")
                for p in prompts[24:32]:
                    await client.submit(p, 2, SAMPLING)
                for _ in range(8):
                    await client.next_finished(timeout=guard(60))
                await wait_until(lambda: served_version(client) > before[0], guard(120),
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


@pytest.mark.integration
async def test_a_drafter_for_another_target_is_refused_and_generation_goes_on(tiny_llama, tmp_path):
    other = EagleConfig(target_vocab_size=999, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2,
                        head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, feature_layers=(2,), draft_vocab_size=64,
                        target_num_layers=2)
    async with RolloutClient(heartbeat_timeout_s=HANG_S) as client:
        with generator_process(client.endpoint, tiny_llama, tmp_path / "gen.log", "--speculative", "eagle"):
            await client.wait_for_generators(1, timeout=guard(60))
            publish_head(client, EagleHead.init(other, torch.arange(64)), 1)
            await wait_until(lambda: "gen-0" in client.drafters.refusals, guard(60), "the generator's refusal")
            assert "vocabulary 999, hidden size 32" in client.drafters.refusals["gen-0"]
            await client.submit([5, 6, 7], 2, SAMPLING)
            group = await client.next_finished(timeout=guard(60))
            assert all(len(s.token_ids) == SAMPLING.max_tokens for s in group.samples)
            assert "gen-0" not in client.drafters.generator_drafters


@pytest.mark.integration
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
                               "--stream-every", "65536"):  # its bound: more than the budget
            await client.wait_for_generators(1, timeout=guard(60))
            publish_head(client, first, 1)
            await wait_until(lambda: served_version(client) == 1, guard(60), "the generator to serve drafter version 1")
            live = await client.submit([5, 17, 33], 2, long)
            await client.submit([6, 17, 33], 1, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
            await client.next_finished(timeout=guard(60))  # the short group: the long one is mid-flight now
            publish_head(client, second, 2)
            await wait_until(lambda: served_version(client) == 2, guard(60), "the generator to serve drafter version 2")
            after = await client.submit([7, 17, 33], 1, SAMPLING)
            assert (await client.next_finished(timeout=guard(120))).group_id == after
            publish_head(client, third, 3)  # the swap flushes the live samples' drafter-2 tokens before its ack
            await wait_until(lambda: served_version(client) == 3, guard(60), "the generator to serve drafter version 3")
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


@pytest.mark.parametrize(("capacity", "below", "expected"), [
    (Capacity(live_seqs=0, max_seqs=0), 0.25, True),  # no load reported: idle
    (Capacity(live_seqs=2, max_seqs=16), 0.25, True),
    (Capacity(live_seqs=12, max_seqs=16), 0.25, False),  # busy: wait for the tail
    (Capacity(live_seqs=12, max_seqs=16), 1.0, True),
    (Capacity(live_seqs=0, max_seqs=16, pause=True), 1.0, False),  # asked to pause
])
def test_schedule_trains_on_idle_capacity_and_pauses_when_asked(tiny_llama, capacity, below, expected):
    ckpt = load_checkpoint(str(tiny_llama))
    target = CausalLM(ckpt.config)
    target.load_weights(ckpt.weights)
    learner = DrafterLearner(target, LearnerConfig(min_rollouts=1))
    learner.add_rollout([5, 6, 7, 8], 2)
    config = RunConfig(model=ModelSection(name=str(tiny_llama)), drafter=DrafterConfig(train_below=below))
    actor = DrafterActor(config, learner, channel=None, connect="tcp://127.0.0.1:1",  # type: ignore[arg-type]
                         actor_id="drafter-0")
    actor.capacity = capacity
    assert actor.may_train() is expected


@pytest.mark.integration
async def test_a_drafter_trainer_for_another_model_exits_with_a_clear_error(tiny_llama, tmp_path):
    """Started without the run's config (another model), it refuses the trainer's policy: exit 2."""
    other = tmp_path / "other"
    other.mkdir()
    write_tiny_checkpoint(other, hidden_size=32, intermediate_size=64)
    config = run_config(other, tmp_path / "run")
    target = CausalLM(load_checkpoint(str(tiny_llama)).config)
    target.load_weights(load_checkpoint(str(tiny_llama)).weights)
    async with RolloutClient(heartbeat_timeout_s=HANG_S) as client:
        await client.publish_weights(dict(target.hf_weights()), version=1, dtype="float32")
        with drafter_process(client.endpoint, config, tmp_path / "drafter.log") as drafter:
            await wait_until(lambda: drafter.poll() is not None, guard(60), "the drafter trainer to exit")
    log = (tmp_path / "drafter.log").read_text()
    assert drafter.returncode == 2, log[-2000:]
    assert "is not the model this drafter trainer loaded" in log and "--config RUN_DIR/config.toml" in log, log[-2000:]


def test_a_resumed_run_warm_starts_from_the_drafter_it_saved(tiny_llama, tmp_path, caplog):
    from specroll.actors.drafter_trainer.actor import build_learner

    cfg = load_checkpoint(str(tiny_llama)).config
    saved = EagleHead.init(EagleConfig.for_target(cfg, eagle3_feature_layers(cfg.num_layers), 64), torch.arange(64))
    saved.save(tmp_path / "drafter")
    config = RunConfig(run_dir=str(tmp_path), model=ModelSection(name=str(tiny_llama)))  # saves to RUN_DIR/drafter
    learner = build_learner(config)
    assert learner.head is not None
    assert head_checksum(learner.head.wire_tensors()) == head_checksum(saved.wire_tensors())
    first = EagleHead.init(saved.config, torch.arange(64), seed=5)  # the head the run began from (a warm start)
    first.save(tmp_path / "warm")
    with_path = msgspec.structs.replace(config, drafter=DrafterConfig(path=str(tmp_path / "warm")))
    assert head_checksum(build_learner(with_path).head.wire_tensors()) == head_checksum(saved.wire_tensors())
    (tmp_path / "drafter" / "model.safetensors").unlink()  # nothing saved yet: drafter.path is the start
    assert head_checksum(build_learner(with_path).head.wire_tensors()) == head_checksum(first.wire_tensors())
    saved.save(tmp_path / "drafter")
    other = tmp_path / "other_run" / "drafter"  # a drafter saved for another model is ignored: cold start
    other_cfg = EagleConfig(target_vocab_size=999, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2,
                            head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, feature_layers=(1,), draft_vocab_size=64,
                            target_num_layers=2)
    EagleHead.init(other_cfg, torch.arange(64)).save(other)
    config = RunConfig(run_dir=str(tmp_path / "other_run"), model=ModelSection(name=str(tiny_llama)),
                       drafter=DrafterConfig(draft_vocab_size=64))
    assert build_learner(config).head is None
    assert "starting cold" in caplog.text


def test_a_damaged_saved_drafter_is_passed_over_for_the_version_before_in_one_line(tiny_llama, tmp_path, caplog):
    """The drafter trainer saves each version as a sealed folder, keeping the one before: a newest one
    changed since it was written (its checksums) is refused, naming the file, for ``drafter.prev``."""
    from specroll.actors.drafter_trainer.actor import build_learner

    cfg = load_checkpoint(str(tiny_llama)).config
    config_of = EagleConfig.for_target(cfg, eagle3_feature_layers(cfg.num_layers), 64)
    older, newer = (EagleHead.init(config_of, torch.arange(64), seed=seed) for seed in (1, 2))
    for head in (older, newer):
        head.save(tmp_path / "drafter", True)  # as the drafter trainer saves a version
    weights = tmp_path / "drafter" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01
    weights.write_bytes(bytes(raw))
    caplog.set_level("INFO", logger="specroll.drafter")
    learner = build_learner(RunConfig(run_dir=str(tmp_path), model=ModelSection(name=str(tiny_llama))))
    assert learner.head is not None
    assert head_checksum(learner.head.wire_tensors()) == head_checksum(older.wire_tensors())
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert line.startswith(f"warm start from {tmp_path / 'drafter.prev'} (the last drafter this run saved); "
                           f"refused drafter {weights}: SHA-256 "), line


def test_a_cold_start_draft_vocabulary_above_the_models_is_refused_not_capped(tiny_llama, tmp_path, capsys):
    """``specroll drafter serve`` refuses what ``specroll launch`` refuses, naming the value and the limit."""
    from specroll.actors.drafter_trainer.actor import build_learner
    from specroll.actors.drafter_trainer.cli import serve
    from specroll.drafter.eagle_config import DrafterError

    config = RunConfig(run_dir=str(tmp_path), model=ModelSection(name=str(tiny_llama)),
                       drafter=DrafterConfig(draft_vocab_size=321))  # the tiny model has 320 tokens
    with pytest.raises(DrafterError, match=r"drafter.draft_vocab_size=321 exceeds the vocabulary of .* \(320 "
                                           r"tokens\); expected at most 320"):
        build_learner(config)
    assert serve(config, "tcp://127.0.0.1:9") == 2  # before connecting: nothing waits for a trainer
    err = capsys.readouterr().err
    assert "specroll drafter serve: error: drafter.draft_vocab_size=321" in err, err
    assert build_learner(msgspec.structs.replace(config, drafter=DrafterConfig(draft_vocab_size=320))).head is None
