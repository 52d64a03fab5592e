"""Bounded work from any peer: every count and size a message carries is checked against a limit
before any work is done for it, answered with an ``Error`` naming the field, the value and the
limit, and the receiving actor goes on serving.

Well-formed messages with extreme values, over real sockets: a generator process (tiny random
checkpoint) fed by a fake trainer, the rollout client fed by a fake generator, a drafter trainer
fed by a fake trainer.
"""

from __future__ import annotations

import contextlib
import math
import random
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from helpers.fake_peers import FakeTrainer, fake_generator, fake_trainer
from helpers.processes import generator_process

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig
from specroll.actors.drafter_trainer.actor import DrafterActor, build_learner
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.drafter.eagle_config import EagleConfig, eagle3_feature_layers
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.checkpoint import load_checkpoint
from specroll.engine.model_config import expected_weight_shapes
from specroll.protocol.channel import Channel
from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckDrafter,
    DrafterAvailable,
    DrafterWeights,
    Error,
    FetchDrafter,
    FetchWeights,
    FinishedRollouts,
    Heartbeat,
    Hello,
    PublishDrafter,
    RolloutChunk,
    RolloutTokens,
    SampleResume,
    Stats,
    SubmitGroup,
    TensorSpec,
    ToDrafter,
    WeightsAvailable,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import close_socket, make_socket

pytestmark = pytest.mark.anyio

MAX_NUM_SEQS, MAX_MODEL_LEN = 4, 64
"""The generator under test: ``--max-num-seqs 4 --max-model-len 64`` (vocabulary 320, conftest's)."""
EXTREMES = (0, -1, 2**31 - 1, 2**63 - 1)
SAMPLING = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def expect_error(trainer: FakeTrainer, *needles: str) -> Error:
    """The next message is an ``Error`` (bad_request) whose text holds every needle."""
    err = await trainer.expect(Error)
    assert err.code == "bad_request" and all(n in err.message for n in needles), (err, needles)
    return err


async def finish(trainer: FakeTrainer, group_id: str, indices: set[int]) -> None:
    """Wait until every sample in ``indices`` of ``group_id`` sent its last chunk (nothing else may come)."""
    while indices:
        msg = await trainer.expect(RolloutChunk)
        assert msg.group_id == group_id, msg
        if msg.finished:
            indices.discard(msg.sample_index)


async def serves_a_normal_group(trainer: FakeTrainer, group_id: str) -> None:
    await trainer.send(SubmitGroup(group_id=group_id, prompt_token_ids=[5, 6, 7], n=2, sampling=SAMPLING))
    await finish(trainer, group_id, {0, 1})


# ---- generator ------------------------------------------------------------------------------


def tiny_drafter(model: Path, **config_overrides: Any) -> tuple[str, tuple[Any, ...], list[torch.Tensor], str]:
    """A real EAGLE head for ``model`` whose JSON config then gets ``config_overrides``: (config,
    refs, tensors, checksum over the tensors) as a ``DrafterWeights`` carries them."""
    cfg = load_checkpoint(str(model)).config
    head = EagleHead.init(EagleConfig.for_target(cfg, eagle3_feature_layers(cfg.num_layers), 64), torch.arange(64))
    tensors = head.wire_tensors()
    config = msgspec.json.encode(msgspec.structs.replace(head.config, **config_overrides)).decode()
    refs, frames = pack_tensors(sorted(tensors.items()))
    return config, refs, frames, head_checksum(tensors)


async def test_a_generator_refuses_extreme_groups_weights_and_drafters_and_keeps_serving(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    shapes = expected_weight_shapes(load_checkpoint(str(model)).config)
    name, shape = next(iter(shapes.items()))
    seqs = f"the limit {MAX_NUM_SEQS} (generator.engine.max_num_seqs)"

    def group(gid: str, **kw: Any) -> SubmitGroup:
        fields: dict[str, Any] = dict(group_id=gid, prompt_token_ids=[5, 6, 7], n=2, sampling=SAMPLING) | kw
        return SubmitGroup(**fields)

    def resumed(index: int, tokens: int) -> SampleResume:
        return SampleResume(index=index, token_ids=[9] * tokens, logprobs=[0.0] * tokens, versions=[0] * tokens)

    refused: list[tuple[Any, tuple[str, ...]]] = [
        (group("n-int32", n=2**31 - 1), ("n = 2147483647", seqs)),
        (group("n-million", n=10**6), ("n = 1000000", seqs)),
        (group("long-prompt", prompt_token_ids=[5] * 10**5), ("len(prompt_token_ids) = 100000", "limit 63")),
        (group("resume-past-context", prompt_token_ids=[5] * 10, sampling=SamplingParams(max_tokens=64),
               resume=(resumed(1, 60),)),
         ("len(prompt_token_ids) + len(resume[0].token_ids) = 70", "limit 63")),
        (group("resume-past-max-tokens", n=2, sampling=SamplingParams(max_tokens=8), resume=(resumed(0, 10**5),)),
         ("len(resume[0].token_ids) = 100000", "limit 8")),
        (group("resume-past-both", n=2, sampling=SamplingParams(max_tokens=2**63 - 1), resume=(resumed(0, 10**5),)),
         ("len(resume[0].token_ids) = 100000", f"limit {MAX_MODEL_LEN}")),
        (group("many-resumed", n=10, resume=tuple(resumed(i, 1) for i in range(MAX_NUM_SEQS + 1))),
         (f"len(resume) = {MAX_NUM_SEQS + 1}", seqs)),
        (group("huge-resumed", n=2**31 - 1, resume=(resumed(0, 1),)), ("n = 2147483647", "limit 65536")),
        (group("out-of-vocab", prompt_token_ids=[5, 6, 2**63 - 1]),
         (f"prompt_token_ids[2] = {2**63 - 1}", "vocabulary [0, 320)")),
        (group("x" * 10**6), ("len(group_id) = 1000000", "limit 256")),
        (group("stops", sampling=SamplingParams(max_tokens=3, stop_token_ids=tuple(range(10**5)))),
         ("len(sampling.stop_token_ids) = 100000", "limit 1024")),
        (Abort(group_id="y" * 10**6), ("Abort.len(group_id) = 1000000", "limit 256")),
        (WeightsAvailable(version=1, dtype="float32", num_chunks=2**31 - 1,
                          params=[TensorSpec(name=name, shape=shape)]),
         ("num_chunks = 2147483647", "limit 1")),
        (WeightsAvailable(version=1, dtype="float32", num_chunks=1,
                          params=[TensorSpec(name=f"p{i}", shape=(1,)) for i in range(10**5)]),
         ("len(params) = 100000", f"limit {len(shapes)}")),
        (WeightsAvailable(version=1, dtype="float32", num_chunks=1, params=[TensorSpec(name="nope", shape=(2**40,))]),
         ("'nope'", "no such parameter")),
    ]
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-model-len", str(MAX_MODEL_LEN), "--speculative", "eagle") as proc:
            await trainer.handshake()
            for msg, needles in refused:
                await trainer.send(msg)
                await expect_error(trainer, *needles)

            # A drafter version whose config names a 2**40-wide layer: refused by its shapes, never built.
            await trainer.send(DrafterAvailable(version=1, policy_version=0, checksum=""))
            assert (await trainer.expect(FetchDrafter)).version == 1
            config, refs, frames, checksum = tiny_drafter(model, intermediate_size=2**40)
            await trainer.send(DrafterWeights(version=1, policy_version=0, config=config, checksum=checksum,
                                              tensors=refs), frames)
            ack = await trainer.expect(AckDrafter)
            assert ack.version == 1 and "shape" in ack.refused, ack
            # One with more tensors than any drafter has: refused before it is checked.
            await trainer.send(DrafterAvailable(version=2, policy_version=0, checksum=""))
            assert (await trainer.expect(FetchDrafter)).version == 2
            refs, frames = pack_tensors((f"t{i}", torch.zeros(1)) for i in range(300))
            await trainer.send(DrafterWeights(version=2, policy_version=0, config=config, checksum=checksum,
                                              tensors=refs), frames)
            await expect_error(trainer, "DrafterWeights.len(tensors) = 300", "limit 256")

            await trainer.next_heartbeat()  # still alive and beating
            await serves_a_normal_group(trainer, "after")
            # max_tokens above the context is not refused: the context ends the responses ("length")
            await trainer.send(SubmitGroup(group_id="long", prompt_token_ids=[5, 6, 7], n=1,
                                           sampling=SamplingParams(temperature=0.0, max_tokens=2**63 - 1,
                                                                   ignore_eos=True)))
            await finish(trainer, "long", {0})
            beat = await trainer.next_heartbeat()
            assert (beat.batch_size, beat.free_seqs) == (0, MAX_NUM_SEQS), "nothing of the refused groups is queued"
            assert proc.poll() is None


def random_submit(rng: random.Random, group_id: str) -> tuple[dict[str, Any], set[int]]:
    """A ``SubmitGroup`` as plain msgpack data (so values its struct would refuse to build can be
    sent too), each field extreme with probability 0.3; and the samples it asks for."""

    def pick(normal: Any) -> Any:
        return rng.choice(EXTREMES) if rng.random() < 0.3 else normal

    n = pick(rng.randint(1, MAX_NUM_SEQS))
    sampling = {"temperature": 0.0, "max_tokens": pick(3), "top_k": pick(0), "seed": pick(None), "ignore_eos": True}
    prompt = [pick(t) for t in (5, 6, 7)] * (30 if rng.random() < 0.1 else 1)  # 90 tokens: past the context
    resume: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        tokens = rng.choice([0, 1, 2, 60, 10**5])
        resume = [{"index": pick(0), "token_ids": [9] * tokens, "logprobs": [0.0] * tokens, "versions": [0] * tokens}]
    msg = {"type": "submit_group", "group_id": group_id, "prompt_token_ids": prompt, "n": n, "sampling": sampling,
           "resume": resume}
    asked = {r["index"] for r in resume} if resume else set(range(n)) if 0 < n <= MAX_NUM_SEQS else set()
    return msg, asked


async def test_random_extreme_groups_are_each_served_or_refused_and_the_generator_lives(tiny_checkpoint, tmp_path):
    """A seeded loop over SubmitGroup fields with extreme integers (0, -1, 2**31-1, 2**63-1): each
    message is either served (every sample it asks for finishes) or answered with one ``Error``."""
    model = tiny_checkpoint("llama")
    rng = random.Random(0)
    served = refused = 0
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-model-len", str(MAX_MODEL_LEN)) as proc:
            await trainer.handshake()
            for i in range(60):
                gid = f"r{i}"
                msg, asked = random_submit(rng, gid)
                await trainer.send(msg)  # plain data: the channel numbers and sends it as it is
                first = await trainer.next()
                while isinstance(first, Error) and first.code == "sequence":
                    first = await trainer.next()  # the number an undecodable message took shows as a gap
                if isinstance(first, Error):
                    assert first.code in ("malformed", "bad_request"), first
                    refused += 1
                    continue
                assert isinstance(first, RolloutChunk) and first.group_id == gid, first
                if first.finished:
                    asked.discard(first.sample_index)
                await finish(trainer, gid, asked)
                served += 1
            assert served and refused, (served, refused)
            await trainer.next_heartbeat()
            await serves_a_normal_group(trainer, "after")
            assert proc.poll() is None


# ---- the rollout client (trainer side) ------------------------------------------------------


def chunk(group_id: str, index: int, tokens: int, offset: int = 0, finished: bool = False) -> RolloutChunk:
    return RolloutChunk(group_id=group_id, sample_index=index, offset=offset, token_ids=[1] * tokens,
                        logprobs=[-1.0] * tokens, versions=[0] * tokens, finished=finished,
                        finish_reason="length" if finished else None)


async def test_the_client_refuses_chunks_past_max_tokens_and_bad_group_ids_and_keeps_serving() -> None:
    async with RolloutClient(heartbeat_timeout_s=30) as client, fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        # Extreme but well-formed statistics are harmless: taken as they are.
        await gen.channel.send(Stats(policy_version=2**63 - 1, num_steps=2**64 - 1, num_tokens=2**64 - 1,
                                     busy_s=math.inf, idle_s=-1.0))
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=2**64 - 1, free_seqs=2**64 - 1))
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "Heartbeat.free_seqs" in err.message and str(2**64 - 1) in err.message
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        sub = await gen.expect(SubmitGroup)
        assert sub.group_id == group_id

        await gen.channel.send(chunk(group_id, 0, 10**6))
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "len(token_ids) = 1000000" in err.message and "limit 8" in err.message
        await gen.channel.send(chunk("g" + "1" * 5000, 0, 1))  # int() of it would raise
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "len(group_id) = 5001" in err.message
        await gen.channel.send(chunk("g²", 0, 1))  # a digit int() does not read: foreign, aborted
        assert (await gen.expect(Abort)).group_id == "g²"

        await gen.channel.send(chunk(group_id, 0, 8, finished=True))
        await gen.channel.send(chunk(group_id, 1, 8, finished=True))
        group = await client.next_finished(timeout=30)
    assert group.group_id == group_id and [len(s.token_ids) for s in group.samples] == [8, 8]


async def test_a_frame_over_the_clients_cap_is_dropped_unread_and_the_generator_goes_on() -> None:
    """A chunk whose frame is over the client's ``max_frame_bytes`` never reaches the codec: the
    socket drops that connection before reading the frame's body (``MAXMSGSIZE``). The generator's
    connection comes back by itself, its next message shows the lost one as a sequence gap, and it
    is told to register again; nothing of the chunk is held."""
    async with RolloutClient(heartbeat_timeout_s=60, max_frame_bytes=1 << 20) as client, \
            fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        assert (await gen.expect(SubmitGroup)).group_id == group_id
        await gen.channel.send(chunk(group_id, 0, 200_000))  # a 2 MB frame
        with anyio.fail_after(60):
            while True:  # a heartbeat carries the next number: the first that gets through shows the gap
                await gen.channel.send(Heartbeat(policy_version=0, batch_size=1, free_groups=0, free_seqs=3))
                with contextlib.suppress(TimeoutError):
                    err = await gen.expect(Error, timeout=0.2)
                    break
        assert err.code == "unknown_peer" and "never arrived" in err.message, err
        assert [len(s.token_ids) for s in client.coordinator.groups[group_id].samples] == [0, 0]
        assert client.coordinator.groups[group_id].generator is None  # queued again


async def test_a_generator_whose_messages_were_lost_registers_again_and_its_groups_resume() -> None:
    """A connection that dropped and came back (a trainer paused past the ZeroMQ heartbeat) loses
    what was in flight: the next message shows a sequence gap. The generator's groups would wait
    forever for chunks no one resends, so the client treats it as gone (its groups resume from the
    tokens held) and answers ``unknown_peer``; after ``Hello`` it gets them back as resumes."""
    async with RolloutClient(heartbeat_timeout_s=60) as client, fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        assert (await gen.expect(SubmitGroup)).group_id == group_id
        await gen.channel.send(chunk(group_id, 0, 3))
        gen.channel._state(gen.channel._key(None)).next_seq += 5  # five messages lost on the way
        await gen.channel.send(chunk(group_id, 0, 4, offset=3))  # held: 3 tokens; these 4 would leave a gap
        err = await gen.expect(Error)
        assert err.code == "unknown_peer" and "never arrived" in err.message, err
        assert client.coordinator.groups[group_id].generator is None  # queued again, to resume

        gen.channel.forget()  # what the generator does on unknown_peer: a new session, then Hello
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        sub = await gen.expect(SubmitGroup)
        assert sub.group_id == group_id and [len(r.token_ids) for r in sub.resume if r.index == 0] == [3]


def test_the_relay_refuses_drafter_versions_past_the_protocol_limits() -> None:
    sent: list[tuple[str, Any]] = []
    relay = DrafterRelay(lambda actor, msg, tensors: sent.append((actor, msg)))
    relay.add_drafter("drafter-0")
    for count, version, needle in ((300, 1, "PublishDrafter.len(tensors) = 300"),
                                   (1, 2**64 - 1, f"PublishDrafter.version = {2**64 - 1}")):
        refs, frames = pack_tensors((f"t{i}", torch.zeros(1)) for i in range(count))
        msg = PublishDrafter(version=version, policy_version=0, config="{}", checksum="c", tensors=refs)
        relay.on_publish("drafter-0", msg, dict(zip((r.name for r in refs), frames, strict=True)))
        assert relay.published is None
        [(actor, err)] = sent
        assert actor == "drafter-0" and isinstance(err, Error) and needle in err.message, err
        sent.clear()


# ---- drafter trainer ------------------------------------------------------------------------


async def test_a_drafter_trainer_refuses_oversized_rollouts_and_weights_and_keeps_running(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    config = RunConfig(run_dir=str(tmp_path / "run"), model=ModelSection(name=str(model)),
                       drafter=DrafterConfig(draft_vocab_size=64))
    threads = torch.get_num_threads()
    learner = build_learner(config)  # sets torch's threads to drafter.num_threads: restored below
    torch.set_num_threads(threads)
    context = learner.target.config.max_position_embeddings
    shapes = {n: tuple(t.shape) for n, t in learner.target.hf_weights().items()}
    peer = b"drafter-0"
    ctx = zmq.asyncio.Context()
    trainer = FakeTrainer(ctx)
    sock = make_socket(ctx, zmq.DEALER, connect=trainer.endpoint, identity=peer)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.serve)
            actor = DrafterActor(config, learner, Channel(sock, ToDrafter), connect=trainer.endpoint,
                                 actor_id=peer.decode())
            done = anyio.Event()

            async def run() -> None:
                await actor.run()
                done.set()

            tg.start_soon(run)
            assert (await trainer.expect(Hello)).role == "drafter"
            await trainer.channel.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"), peer=peer)

            long = RolloutTokens(prompt_token_ids=[5] * context, token_ids=[6] * 10**5, policy_version=0)
            await trainer.channel.send(FinishedRollouts(rollouts=[long]), peer=peer)
            err = await trainer.expect(Error)
            assert f"= {context + 10**5}" in err.message and f"limit {context}" in err.message, err
            tiny = RolloutTokens(prompt_token_ids=[5], token_ids=[6], policy_version=0)
            await trainer.channel.send(FinishedRollouts(rollouts=[tiny] * 70_000), peer=peer)
            err = await trainer.expect(Error)
            assert "len(rollouts) = 70000" in err.message and "limit 65536" in err.message, err
            await trainer.channel.send(DrafterAvailable(version=2**64 - 1, policy_version=0, checksum=""), peer=peer)
            err = await trainer.expect(Error)  # its next version would not fit the wire
            assert f"DrafterAvailable.version = {2**64 - 1}" in err.message and f"limit {2**62}" in err.message, err
            params = [TensorSpec(name=n, shape=s) for n, s in shapes.items()]
            await trainer.channel.send(WeightsAvailable(version=1, dtype="float32", num_chunks=2**31 - 1,
                                                        params=params), peer=peer)
            err = await trainer.expect(Error)
            assert "num_chunks = 2147483647" in err.message and f"limit {len(shapes)}" in err.message, err
            await trainer.channel.send(WeightsAvailable(version=1, dtype="float32", num_chunks=1, params=params),
                                       peer=peer)
            assert (await trainer.expect(FetchWeights)).version == 1  # a sane announcement is fetched
            assert not done.is_set()
            assert learner.num_rollouts == 0 and not actor._rollouts  # nothing of the refused messages kept
            actor.stop(0, "test over")
            with anyio.fail_after(30):
                await done.wait()
            tg.cancel_scope.cancel()
    finally:
        close_socket(sock)
        close_socket(trainer.sock)
        ctx.term()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


async def test_a_huge_resume_list_costs_a_generator_no_memory_and_it_keeps_serving(tiny_checkpoint, tmp_path):
    """A 3M-token resume (a 33 MB frame) is over what this generator accepts as a message (its
    context and sequences: ``SubmitLimits.max_header_bytes``) and over any tensor of its model, so
    its socket drops the frame unread (``MAXMSGSIZE``); decoded, its lists would take ~160 MB. The
    trainer's next message reports the lost one (a sequence gap), and the generator serves it."""
    model = tiny_checkpoint("llama")
    tokens = 3_000_000
    huge = SubmitGroup(group_id="huge", prompt_token_ids=[5, 6, 7], n=1, sampling=SAMPLING,
                       resume=(SampleResume(index=0, token_ids=[9] * tokens, logprobs=[-0.5] * tokens,
                                            versions=[0] * tokens),))
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-model-len", str(MAX_MODEL_LEN)) as proc:
            await trainer.handshake()
            await serves_a_normal_group(trainer, "before")
            before = peak_rss_mb(proc.pid)
            await trainer.send(huge)
            log = tmp_path / "gen.log"
            with anyio.fail_after(60):  # dropped unread, the connection is made afresh
                while log.read_text().count("connected to the trainer") < 2:
                    await anyio.sleep(0.05)
            await trainer.send(SubmitGroup(group_id="after", prompt_token_ids=[5, 6, 7], n=2, sampling=SAMPLING))
            err = await trainer.expect(Error)
            assert err.code == "sequence" and "gap" in err.message, err
            await finish(trainer, "after", {0, 1})
            grown = peak_rss_mb(proc.pid) - before
            assert grown < 40, f"the generator's peak memory grew by {grown:.0f} MiB"
            assert proc.poll() is None
