"""The generator actor as a real process against a fake trainer (a ROUTER channel in the test).

Each test starts ``python -m specroll.actors.generator`` in its own process group on a tiny
random checkpoint and always kills and reaps it, also on failure. How a generator ends:
``test_generator_exit.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import TOKEN_A, TOKEN_B, reveal_weights, write_tiny_checkpoint
from helpers.fake_peers import LONG_CONTEXT, PEER, collect, fake_trainer, joined
from helpers.processes import generator_process

from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.codec import encode, pack_tensors
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckWeights,
    Error,
    FetchWeights,
    Hello,
    RolloutChunk,
    SampleResume,
    SubmitGroup,
    TensorSpec,
    WeightsAvailable,
    WeightsChunk,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

KV_GB = 0.02


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def load_checkpoint_weights(model: Path) -> dict[str, torch.Tensor]:
    from specroll.engine.loaders.checkpoint import load_checkpoint

    return load_checkpoint(model).weights


def local_engine(model: Path) -> Engine:
    return Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=KV_GB))


def reference_tokens(engine: Engine, prompt: list[int], sampling: SamplingParams) -> list[int]:
    """What ``engine`` alone generates for ``prompt``."""
    engine.add_request(prompt, sampling, "ref")
    return run_to_completion(engine)["ref"].token_ids


# ---- tests ----------------------------------------------------------------------------------


async def test_handshake_greedy_group_and_resume(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    prompt = [5, 17, 42, 9, 77, 3]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = local_engine(model)
    expected = reference_tokens(reference, prompt, sampling)
    expected_resumed = reference_tokens(reference, prompt + expected[:5],
                                        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))

    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--stream-every", "3",
                               "--max-num-seqs", "8") as proc:
            await trainer.handshake()
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=prompt, n=2, sampling=sampling))
            chunks = await collect(trainer, "g", {0, 1})
            for i in (0, 1):
                tokens, versions = joined(chunks[i])
                assert tokens == expected
                assert versions == [0] * len(expected)
                assert all(len(c.token_ids) == len(c.logprobs) and c.spec is None for c in chunks[i])
                assert chunks[i][-1].finish_reason == "length"
                assert len(chunks[i]) >= 3, "streamed in several chunks"

            # Resume sample 1 from its first 5 tokens (as after a generator died): chunks go on at offset 5.
            done = SampleResume(index=1, token_ids=expected[:5], logprobs=[0.0] * 5, versions=[0] * 5)
            await trainer.send(SubmitGroup(group_id="g2", prompt_token_ids=prompt, n=2, sampling=sampling,
                                           resume=(done,)))
            resumed = await collect(trainer, "g2", {1}, first_offset=5)
            assert joined(resumed[1])[0] == expected_resumed

            await trainer.send(Abort(group_id="nope"))
            err = await trainer.expect(Error)
            assert err.code == "unknown_group" and "nope" in err.message
            beat = await trainer.next_heartbeat()
            assert (beat.policy_version, beat.batch_size, beat.free_seqs, beat.free_groups) == (0, 0, 8, 4)
            assert proc.poll() is None


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
async def test_version_attribution_across_a_weight_update(tmp_path: Path, kv_policy: str) -> None:
    model = tmp_path / "reveal"
    model.mkdir()
    write_tiny_checkpoint(model, "llama", tie_word_embeddings=False, max_position_embeddings=LONG_CONTEXT)
    weights_b = reveal_weights(model)
    sampling = SamplingParams(temperature=0.0, max_tokens=LONG_CONTEXT - 8, ignore_eos=True)
    params = [TensorSpec(name=n, shape=tuple(t.shape)) for n, t in weights_b.items()]

    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--stream-every", "1",
                               "--kv-policy", kv_policy):
            await trainer.handshake()
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=[7, 8, 9], n=2, sampling=sampling))
            first = await trainer.expect(RolloutChunk)
            assert first.token_ids and set(first.versions) == {0}
            await trainer.send(WeightsAvailable(version=1, dtype="float32", params=params, num_chunks=1))
            seen: list[Any] = [first]
            while not isinstance(seen[-1], FetchWeights):
                seen.append(await trainer.next())
            assert seen[-1].version == 1
            refs, tensors = pack_tensors(weights_b.items())
            await trainer.send(WeightsChunk(version=1, index=0, num_chunks=1, tensors=refs), tensors)
            seen.append(await trainer.next())  # nothing but chunks until the ack
            while not isinstance(seen[-1], AckWeights):
                assert isinstance(seen[-1], RolloutChunk), seen[-1]
                seen.append(await trainer.next())
            acked = len(seen)

            def sampled_after_update(i: int) -> bool:
                return any(c.sample_index == i and 1 in c.versions for c in seen[acked:])

            while not (sampled_after_update(0) and sampled_after_update(1)):  # then stop the long rollout
                seen.append(await trainer.expect(RolloutChunk))
            await trainer.send(Abort(group_id="g"))
            others: list[Any] = []
            got = await collect(trainer, "g", {0, 1}, others=others, prior=seen)
            assert [type(m) for m in others] == [FetchWeights, AckWeights], others
            assert seen[acked - 1].version == 1
            sent_before_ack = {id(m) for m in seen[:acked - 1]}

        for i in (0, 1):
            chunks = got[i]
            assert [c.offset for c in chunks] == [sum(len(c.token_ids) for c in chunks[:j]) for j in range(len(chunks))]
            tokens, versions = joined(chunks)
            assert 0 < len(tokens) < sampling.max_tokens and chunks[-1].finish_reason == "abort"
            # Each token's version is that of the weights that produced it: A ⇔ version 0, B ⇔ version 1.
            assert [{0: TOKEN_A, 1: TOKEN_B}[v] for v in versions] == tokens
            assert versions == sorted(versions) and set(versions) == {0, 1}, "both versions within one rollout"
            # stream_every=1: a chunk sent after the ack holds only tokens of steps after the update.
            after_ack = [c for c in chunks if id(c) not in sent_before_ack]
            assert all(set(c.versions) == {1} for c in after_ack if c.token_ids)


async def test_bad_update_is_refused_and_the_old_version_kept(tmp_path: Path, tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama", tie_word_embeddings=False)
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--speculative", "suffix"):
            await trainer.handshake()
            bad = {"lm_head.weight": torch.zeros(3, 3)}
            await trainer.send(WeightsAvailable(version=1, dtype="float32", num_chunks=1,
                                                params=[TensorSpec(name="lm_head.weight", shape=(3, 3))]))
            assert (await trainer.expect(FetchWeights)).version == 1
            refs, tensors = pack_tensors(bad.items())
            await trainer.send(WeightsChunk(version=1, index=0, num_chunks=1, tensors=refs), tensors)
            err = await trainer.expect(Error)
            assert err.code == "bad_request" and "lm_head.weight" in err.message
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=[4, 5], n=1,
                                           sampling=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
            chunks = await collect(trainer, "g", {0})
            assert joined(chunks[0])[1] == [0, 0, 0]
            assert all(c.spec is not None for c in chunks[0]), "speculating: chunks carry SpecStats"
            assert (await trainer.next_heartbeat()).policy_version == 0


async def test_a_newer_version_supersedes_an_unfinished_fetch(tmp_path: Path, tiny_checkpoint) -> None:
    """The trainer announces v1, sends half of it and moves on to v2 (or restarted): the generator
    drops the half-fetched v1 and serves v2, instead of waiting for v1 forever."""
    model = tiny_checkpoint("llama", tie_word_embeddings=False)
    weights = load_checkpoint_weights(model)
    names = ["lm_head.weight", "model.norm.weight"]
    specs = [TensorSpec(name=n, shape=tuple(weights[n].shape)) for n in names]
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log"):
            await trainer.handshake()
            await trainer.send(WeightsAvailable(version=1, dtype="float32", num_chunks=2, params=specs))
            assert (await trainer.expect(FetchWeights)).version == 1
            refs, tensors = pack_tensors([(names[0], weights[names[0]])])
            await trainer.send(WeightsChunk(version=1, index=0, num_chunks=2, tensors=refs), tensors)
            await trainer.send(WeightsAvailable(version=2, dtype="float32", num_chunks=1, params=specs))
            assert (await trainer.expect(FetchWeights)).version == 2
            refs, tensors = pack_tensors([(n, weights[n]) for n in names])
            await trainer.send(WeightsChunk(version=2, index=0, num_chunks=1, tensors=refs), tensors)
            assert (await trainer.expect(AckWeights)).version == 2


def fuzz_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """Random and corrupted frames, each of which a generator must refuse (none is acceptable work)."""
    refs, tensors = pack_tensors([("w", torch.ones(4))])
    valid: list[tuple[Any, list[torch.Tensor]]] = [
        (Welcome(protocol_version=PROTOCOL_VERSION, actor_id="x"), []),  # after the handshake: unexpected
        (Abort(group_id="never-submitted"), []),
        (WeightsChunk(version=9, index=0, num_chunks=1, tensors=refs), tensors),  # never fetched
    ]
    frames: list[list[bytes]] = []
    for i in range(n):
        msg, ts = rng.choice(valid)
        # A session of its own for each, so the real stream's numbering is untouched.
        base = [bytes(f) for f in encode(msg, ts, session=rng.randrange(2**62, 2**63), seq=rng.randrange(1000))]
        header = bytearray(base[0])
        kind = i % 5
        if kind == 0:
            frames.append([rng.randbytes(rng.randrange(0, 64))])
        elif kind == 1:
            frames.append([bytes(header[: rng.randrange(len(header))]), *base[1:]])
        elif kind == 2:
            pos = rng.randrange(len(header))
            header[pos] ^= 1 << rng.randrange(8)
            frames.append([bytes(header), *base[1:]])
        elif kind == 3:
            frames.append([*base, rng.randbytes(5)])  # an unreferenced extra frame
        else:
            frames.append(base)  # well-formed but unacceptable
    return frames


async def test_random_frames_are_refused_and_the_generator_keeps_serving(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    log = tmp_path / "gen.log"
    n = 10_000
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, log) as proc:
            await trainer.handshake()
            for frames in fuzz_frames(random.Random(0), n):
                await trainer.sock.send_multipart([PEER, *frames])
            await trainer.send(SubmitGroup(group_id="after", prompt_token_ids=[3, 4, 5], n=2, sampling=sampling))
            others: list[Any] = []
            chunks = await collect(trainer, "after", {0, 1}, others=others)
            assert all(len(joined(chunks[i])[0]) == 5 for i in (0, 1))
            assert proc.poll() is None
            errors = [m for m in others if isinstance(m, Error)]
            assert errors and all(e.code in ("malformed", "bad_request", "unknown_group") for e in errors)
            assert not trainer.bad
    refused = log.read_text().count("refused (")
    assert refused >= n, f"{refused} refusals logged for {n} bad frames"


async def test_a_prompt_longer_than_the_prefill_budget_with_speculation_on(tiny_checkpoint, tmp_path: Path) -> None:
    """A 2,100-token prompt under the default budget of 2,048 tokens a step: its first prefill chunk
    samples nothing, with drafts to verify for no sequence. The group comes back whole, equal to
    plain greedy decoding, and the generator keeps serving."""
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    motif = [5, 17, 42, 9, 77, 3, 250]
    prompt = (motif * 300)[:2100]
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = local_engine(model)
    assert reference.config.max_num_batched_tokens < len(prompt)
    expected = reference_tokens(reference, prompt, sampling)
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--speculative", "suffix",
                               "--num-draft-tokens", "4") as proc:
            await trainer.handshake()
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=prompt, n=2, sampling=sampling))
            chunks = await collect(trainer, "g", {0, 1})
            for i in (0, 1):
                assert joined(chunks[i])[0] == expected
                assert chunks[i][-1].finish_reason == "length"
            await trainer.send(SubmitGroup(group_id="g2", prompt_token_ids=prompt[:50], n=1, sampling=sampling))
            assert len(joined((await collect(trainer, "g2", {0}))[0])[0]) == sampling.max_tokens
            assert proc.poll() is None


@pytest.mark.parametrize("sign", ["unknown_peer", "gap"])
async def test_registering_again_drops_the_live_groups_so_the_trainer_can_resume_them_here(
        tiny_checkpoint, tmp_path: Path, sign: str) -> None:
    """A generator registers again when the trainer says ``unknown_peer`` (it declared the generator
    gone) or when the trainer's stream shows a gap: messages that never arrived (a ROUTER drops those
    for a peer whose connection is gone) may have carried groups the trainer counts as this
    generator's and would wait for without end (a chaos run hung so); the message after the gap is
    not read. Either way it drops its live groups without another chunk, and the same group sent
    back to it resumes at the offset the trainer holds. Before, the old copy kept streaming after
    ``Hello`` (its chunks then count as refusals of the resumed copy) and the resubmit was refused as
    "already live here"; and on a gap the generator read on and started the group after it."""
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    prompt = [5, 17, 42, 9, 77, 3]
    sampling = SamplingParams(temperature=0.0, max_tokens=LONG_CONTEXT - len(prompt), ignore_eos=True)
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--stream-every", "2") as proc:
            await trainer.handshake()
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=prompt, n=1, sampling=sampling))
            first = await trainer.expect(RolloutChunk)
            held = first.token_ids  # what the trainer keeps of the old copy: its first chunk only
            if sign == "gap":
                trainer.lose(1)  # a SubmitGroup the generator never gets
                await trainer.send(SubmitGroup(group_id="after", prompt_token_ids=prompt, n=1, sampling=sampling))
            else:
                await trainer.send(Error(code="unknown_peer", message="your messages 2..9 never arrived"))
            refusals = []
            while not isinstance(msg := await trainer.next(), Hello):
                if isinstance(msg, Error):
                    refusals.append(msg.code)
                else:  # the old copy's chunks sent before it; nothing of the group after the gap
                    assert isinstance(msg, RolloutChunk) and msg.group_id == "g" and not msg.finished, f"{msg!r:.300}"
            assert refusals == (["sequence"] if sign == "gap" else [])
            await trainer.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"))
            done = SampleResume(index=0, token_ids=held, logprobs=list(first.logprobs), versions=list(first.versions))
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=prompt, n=1, sampling=sampling,
                                           resume=(done,)))
            resumed = await trainer.expect(RolloutChunk)  # no old chunk, no "already live" Error before it
            assert (resumed.group_id, resumed.offset) == ("g", len(held))
            await trainer.send(Abort(group_id="g"))
            rest = await collect(trainer, "g", {0}, first_offset=len(held) + len(resumed.token_ids))
            assert rest[0][-1].finish_reason == "abort"
            tokens = held + resumed.token_ids + joined(rest[0])[0]
            expected = reference_tokens(local_engine(model), prompt,
                                        SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True))
            assert tokens == expected  # greedy: the resumed copy goes on where the trainer's tokens end
            assert proc.poll() is None
