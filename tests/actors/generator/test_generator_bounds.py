"""Bounded work from any peer: every count and size a message carries is checked against a limit
before any work is done for it, answered with an ``Error`` naming the field, the value and the
limit, and the receiving actor goes on serving.

Well-formed messages with extreme values, over real sockets: a generator process (tiny random
checkpoint) fed by a fake trainer. The rollout client's bounds: ``test_client_bounds.py``; the
drafter trainer's: ``test_drafter_trainer_bounds.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
from helpers.fake_peers import FakeTrainer, fake_trainer
from helpers.processes import generator_process
from helpers.timeouts import guard

from specroll.drafter.eagle_config import EagleConfig, eagle3_feature_layers
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model_config import expected_weight_shapes
from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckDrafter,
    DrafterAvailable,
    DrafterWeights,
    Error,
    FetchDrafter,
    Hello,
    RolloutChunk,
    SampleResume,
    SubmitGroup,
    TensorSpec,
    WeightsAvailable,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

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
    trainer's next message reports the lost one (a sequence gap): the generator registers again (the
    trainer writes off the group it never got) and serves what comes after the ``Welcome``."""
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
            with anyio.fail_after(guard(60)):  # dropped unread, the connection is made afresh
                while log.read_text().count("connected to the trainer") < 2:
                    await anyio.sleep(0.05)
            after = SubmitGroup(group_id="after", prompt_token_ids=[5, 6, 7], n=2, sampling=SAMPLING)
            await trainer.send(after)
            err = await trainer.expect(Error)
            assert err.code == "sequence" and "gap" in err.message, err
            await trainer.expect(Hello)  # not the group after the gap
            await trainer.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"))
            await trainer.send(after)
            await finish(trainer, "after", {0, 1})
            grown = peak_rss_mb(proc.pid) - before
            assert grown < 40, f"the generator's peak memory grew by {grown:.0f} MiB"
            assert proc.poll() is None
