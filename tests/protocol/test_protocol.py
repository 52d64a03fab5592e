"""Wire messages and codec: every message round-trips, tensors are bit-exact, malformed frames raise ProtocolError."""

from __future__ import annotations

import random
import typing
import warnings

import msgspec
import pytest
import torch
from helpers.timeouts import guard

from specroll.protocol.codec import ProtocolError, decode, encode, pack_tensors
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckDrafter,
    AckResetPrefixCache,
    AckWeights,
    Capacity,
    Credit,
    Dead,
    DrafterAvailable,
    DrafterWeights,
    Error,
    FetchDrafter,
    FetchWeights,
    FinishedRollouts,
    Heartbeat,
    Hello,
    JoinWeightsGroup,
    PublishDrafter,
    Refuse,
    ResetPrefixCache,
    RolloutChunk,
    RolloutTokens,
    SampleResume,
    SpecStats,
    Stats,
    SubmitGroup,
    TensorSpec,
    ToDrafter,
    ToGenerator,
    ToTrainer,
    WeightsAvailable,
    WeightsBroadcast,
    WeightsChunk,
    WeightsGroup,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams

_resume = SampleResume(index=1, token_ids=[7, 8], logprobs=[-0.5, -1.25], versions=[3, 4])
TO_TRAINER = [
    Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="gen-0", capabilities=("resume",)),
    RolloutChunk(group_id="g", sample_index=2, offset=5, token_ids=[1, 2], logprobs=[-0.1, -2.0], versions=[3, 3]),
    RolloutChunk(
        group_id="g", sample_index=0, offset=0, token_ids=[9], logprobs=[-0.0], versions=[4], finished=True,
        finish_reason="stop", spec=SpecStats(num_drafted=8, num_accepted=5, num_draft_steps=2),
    ),
    FetchWeights(version=4),
    FetchWeights(version=5, transport="collective"),
    JoinWeightsGroup(device="cuda"),
    AckWeights(version=4),
    Heartbeat(policy_version=4, batch_size=12, free_groups=2, free_seqs=16),
    Stats(policy_version=4, num_steps=10, num_tokens=300, busy_s=1.5, idle_s=0.25, spec=SpecStats(num_drafted=1)),
    Stats(policy_version=4, num_steps=10, num_tokens=300, busy_s=1.5, idle_s=0.25, prompt_tokens=90,
          cached_prompt_tokens=64),
    AckResetPrefixCache(request_id=3),
    Credit(limit=128),
    Error(code="malformed", message="bad header", seq=7),
    Dead(actor_id="gen-0", reason="SIGTERM"),
    FetchDrafter(version=2),
    AckDrafter(version=2, checksum="ab" * 32),
    AckDrafter(version=3, checksum="", refused="made for another target"),
    PublishDrafter(version=2, policy_version=5, config="{}", checksum="cd" * 32, tensors=(), train_steps=40),
    RolloutChunk(group_id="g", sample_index=0, offset=3, token_ids=[1], logprobs=[-1.0], versions=[2],
                 spec=SpecStats(num_drafted=4, num_accepted=1, num_draft_steps=1, drafter_version=7)),
]  # fmt: skip
TO_GENERATOR = [
    Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"),
    Refuse(reason="protocol version 2, expected 1"),
    SubmitGroup(group_id="g", prompt_token_ids=[1, 2, 3], n=4, sampling=SamplingParams(temperature=0.7, seed=3)),
    SubmitGroup(group_id="g", prompt_token_ids=[1], n=2, sampling=SamplingParams(), resume=(_resume,)),
    Abort(group_id="g"),
    ResetPrefixCache(request_id=3),
    WeightsAvailable(version=4, dtype="bfloat16", params=[TensorSpec(name="w", shape=(2, 3))], num_chunks=1),
    WeightsAvailable(version=5, dtype="float32", params=[TensorSpec(name="w", shape=(2, 3))], num_chunks=1,
                     transport="collective", bucket_bytes=16, bucket_checksums=(1, 2**32 - 1)),
    WeightsChunk(version=4, index=0, num_chunks=1, tensors=()),
    WeightsGroup(name="weights-0", host="127.0.0.1", port=41234, backend="gloo", timeout_s=guard(10.0)),
    WeightsGroup(name="", host="", port=0, refused="chunks only"),
    WeightsBroadcast(version=5, group="weights-0"),
    Credit(limit=3),
    Error(code="unknown_group", message="no group 'x'"),
    Dead(actor_id="trainer"),
    DrafterAvailable(version=2, policy_version=5, checksum="cd" * 32),
    DrafterWeights(version=2, policy_version=5, config="{}", checksum="cd" * 32, tensors=()),
]
TO_DRAFTER = [
    FinishedRollouts(rollouts=[RolloutTokens(prompt_token_ids=[1, 2], token_ids=[3, 4, 5], policy_version=6)]),
    Capacity(live_seqs=3, max_seqs=128),
    Capacity(live_seqs=0, max_seqs=0, pause=True),
]


def _header(msg: object, session: int = 1, seq: int = 0) -> bytes:
    """A raw header frame built without the typed encoder, so tests can put anything in it."""
    return msgspec.msgpack.encode([session, seq, msg])


def test_every_message_type_is_exercised():
    sent = {type(m) for m in TO_TRAINER} | {type(m) for m in TO_GENERATOR} | {type(m) for m in TO_DRAFTER}
    unions = (ToTrainer, ToGenerator, ToDrafter)
    assert sent == {t for union in unions for t in typing.get_args(union)}


@pytest.mark.parametrize(
    ("msg", "union"),
    [(m, ToTrainer) for m in TO_TRAINER] + [(m, ToGenerator) for m in TO_GENERATOR]
    + [(m, ToDrafter) for m in TO_DRAFTER],
    ids=repr,
)
def test_message_round_trip(msg, union):
    frames = encode(msg, session=11, seq=42)
    assert len(frames) == 1
    d = decode(frames, union)
    assert (d.msg, d.session, d.seq, d.tensors) == (msg, 11, 42, {})
    assert type(d.msg) is type(msg)


def test_message_sent_the_wrong_way_is_refused():
    with pytest.raises(ProtocolError, match="Invalid value 'submit_group'"):
        decode(encode(TO_GENERATOR[2]), ToTrainer)


def test_hello_of_a_newer_version_still_decodes():
    """A peer of another version must get a clear Refuse, so Hello tolerates fields it does not know."""
    raw = {"type": "hello", "protocol_version": 99, "role": "critic", "actor_id": "x", "new_field": [1]}
    assert decode([_header(raw)], ToTrainer).msg == Hello(protocol_version=99, role="critic", actor_id="x")


def test_stats_without_the_prefix_cache_counters_decodes_with_zeros():
    """The counters were added at the end with defaults: a Stats that lacks them still decodes."""
    raw = {"type": "stats", "policy_version": 1, "num_steps": 2, "num_tokens": 3, "busy_s": 0.5, "idle_s": 0.0}
    msg = decode([_header(raw)], ToTrainer).msg
    assert isinstance(msg, Stats) and (msg.prompt_tokens, msg.cached_prompt_tokens) == (0, 0)
    with pytest.raises(ProtocolError, match="prompt_tokens"):
        decode([_header({**raw, "prompt_tokens": -1})], ToTrainer)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 5),
        torch.randint(-(2**15), 2**15, (7, 3), dtype=torch.int16).view(torch.bfloat16),  # every bit pattern, NaNs too
        torch.randint(-(2**62), 2**62, (6,), dtype=torch.int64),
        torch.empty(0),
        torch.empty(3, 0),
        torch.randn(6, 4).t(),  # non-contiguous
        torch.randn(4, 6, dtype=torch.float16)[:, ::2],  # non-contiguous, strided
        torch.tensor(2.5),  # 0-dim
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int32),
        torch.arange(256, dtype=torch.int16).to(torch.uint8),
    ],
    ids=lambda t: f"{t.dtype}{tuple(t.shape)}{'' if t.is_contiguous() else '-strided'}",
)
def test_tensor_round_trip_is_bit_exact(tensor):
    refs, tensors = pack_tensors([("w", tensor), ("extra", torch.ones(2))])
    msg = WeightsChunk(version=1, index=0, num_chunks=1, tensors=refs)
    frames = encode(msg, tensors)
    assert len(frames) == 3
    d = decode([bytes(f) for f in frames], ToGenerator)
    assert d.msg == msg
    out = d.tensors["w"]
    assert (out.dtype, out.shape) == (tensor.dtype, tensor.shape)
    assert torch.equal(_bits(out), _bits(tensor))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out.zero_()  # a writable copy: no read-only-buffer warning, and the frame is untouched
    assert torch.equal(d.tensors["extra"], torch.ones(2))


def test_contiguous_tensor_frame_is_zero_copy():
    t = torch.arange(8, dtype=torch.float32)
    refs, tensors = pack_tensors([("t", t)])
    frame = encode(WeightsChunk(version=0, index=0, num_chunks=1, tensors=refs), tensors)[1]
    t[0] = 99.0  # the frame views the tensor's memory
    assert bytes(frame)[:4] == torch.tensor([99.0]).view(torch.uint8).numpy().tobytes()


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(ValueError, match="float64"):
        pack_tensors([("x", torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="twice"):
        pack_tensors([("x", torch.zeros(2)), ("x", torch.zeros(2))])
    refs, _ = pack_tensors([("x", torch.zeros(2))])
    msg = WeightsChunk(version=0, index=0, num_chunks=1, tensors=refs)
    with pytest.raises(ValueError, match="references 1 tensors but 0"):
        encode(msg, [])
    with pytest.raises(ValueError, match="its ref says float32"):
        encode(msg, [torch.zeros(3)])


def test_message_invariants_hold_on_construction():
    with pytest.raises(ValueError, match="equal lengths"):
        RolloutChunk(group_id="g", sample_index=0, offset=0, token_ids=[1], logprobs=[], versions=[1])
    with pytest.raises(ValueError, match="exactly when finished"):
        RolloutChunk(group_id="g", sample_index=0, offset=0, token_ids=[], logprobs=[], versions=[], finished=True)
    with pytest.raises(ValueError, match=r"resume indices \[1, 1\]"):
        SubmitGroup(group_id="g", prompt_token_ids=[1], n=2, sampling=SamplingParams(), resume=(_resume, _resume))


def _chunk_header(shape: object = (2,), dtype: str = "float32", frame: int = 1, extra: tuple = ()) -> bytes:
    ref = {"name": "w", "dtype": dtype, "shape": shape, "frame": frame}
    return _header({"type": "weights_chunk", "version": 1, "index": 0, "num_chunks": 1, "tensors": [ref, *extra]})


_F32x2 = bytes(8)
_CHUNK = {"type": "rollout_chunk", "group_id": "g", "sample_index": 0, "offset": 0}
MALFORMED = {
    "no frames": ([], "non-empty sequence of frames"),
    "msgpack garbage": ([b"\xc1\x00"], "malformed"),
    "truncated header": ([_chunk_header()[:-3], _F32x2], "truncated"),
    "header not an array": ([msgspec.msgpack.encode("hello")], "Expected `array`"),
    "unknown tag": ([_header({"type": "launch_missiles"})], "Invalid value 'launch_missiles'"),
    "missing tag": ([_header({"group_id": "g"})], "missing required field `type`"),
    "unknown field": ([_header({"type": "abort", "group_id": "g", "x": 1})], "unknown field `x`"),
    "wrong field type": ([_header({"type": "abort", "group_id": 5})], "Expected `str`, got `int`"),
    "negative seq": ([_header({"type": "abort", "group_id": "g"}, seq=-1)], "Expected `int` >= 0 - at `$[1]`"),
    "misaligned chunk": (
        [_header(_CHUNK | {"token_ids": [1, 2], "logprobs": [0.0], "versions": [0, 0]})],
        "2 token ids, 1 logprobs",
    ),
    "dtype outside allowlist": ([_chunk_header(dtype="float64"), _F32x2], "Invalid enum value 'float64'"),
    "negative dim": ([_chunk_header(shape=(-2,)), _F32x2], "Expected `int` >= 0"),
    "shape/bytes mismatch": ([_chunk_header(shape=(3,)), _F32x2], "needs 12 bytes; frame 1 has 8"),
    "huge shape": ([_chunk_header(shape=(2**40, 2**40)), _F32x2], "needs 4835703278458516698824704 bytes"),
    "huge dim of empty tensor": ([_chunk_header(shape=(0, 2**64 - 1)), b""], "at most 32 dims of <= 2**40"),
    "too many dims": ([_chunk_header(shape=(1,) * 40), b"\0" * 4], "at most 32 dims"),
    "frame index 0": ([_chunk_header(frame=0), _F32x2], "Expected `int` >= 1"),
    "frame index out of range": ([_chunk_header(frame=2), _F32x2], "frame 2; expected an unused frame in 1..1"),
    "frame used twice": (
        [_chunk_header(extra=({"name": "v", "dtype": "uint8", "shape": [8], "frame": 1},)), _F32x2, _F32x2],
        "refers to frame 1; expected an unused frame",
    ),
    "name used twice": (
        [_chunk_header(extra=({"name": "w", "dtype": "uint8", "shape": [8], "frame": 2},)), _F32x2, _F32x2],
        "names tensor 'w' twice",
    ),
    "missing tensor frame": ([_chunk_header()], "references 1 tensors but came with 0 tensor frames"),
    "extra frame": ([_header({"type": "abort", "group_id": "g"}), b"x"], "references 0 tensors but came with 1"),
    "bool not 0/1": ([_chunk_header(shape=(2,), dtype="bool"), b"\x01\x02"], "bytes other than 0 and 1"),
    "frame not a buffer": ([_chunk_header(), 12345], "frame 1 is not a contiguous byte buffer"),
    "header not a buffer": (["text"], "frame 0 is not a contiguous byte buffer"),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_frames_raise_protocol_error(case):
    frames, message = MALFORMED[case]
    with pytest.raises(ProtocolError) as err:
        decode(frames, ToGenerator | ToTrainer)
    assert message in str(err.value)


def test_protocol_error_names_the_seq_when_known():
    with pytest.raises(ProtocolError) as err:
        decode([_header({"type": "abort", "group_id": "g"}, seq=17), b"x"], ToGenerator)
    assert err.value.seq == 17


def test_oversize_header_is_refused_before_decoding():
    frames = encode(Abort(group_id="g" * 100))
    with pytest.raises(ProtocolError, match=r"header frame has 1\d\d bytes; the limit is 64"):
        decode(frames, ToGenerator, max_header_bytes=64)


def _random_msgpack(rng: random.Random, depth: int = 0) -> object:
    choices = [
        lambda: rng.choice([rng.randint(-(2**63), 2**64 - 1), rng.randint(-3, 3)]),
        lambda: rng.random(),
        lambda: rng.choice(["weights_chunk", "rollout_chunk", "abort", "hello", "type", "tensors", "shape", ""]),
        lambda: None,
        lambda: rng.randbytes(rng.randint(0, 8)),
    ]
    if depth < 4:
        choices.append(lambda: [_random_msgpack(rng, depth + 1) for _ in range(rng.randint(0, 4))])
        choices.append(lambda: {str(_random_msgpack(rng, 9)): _random_msgpack(rng, depth + 1) for _ in range(3)})
    return rng.choice(choices)()


def _mutate(frames: list[bytes], rng: random.Random) -> list[object]:
    """One corrupted variant of a valid frame list."""
    frames = list(frames)
    kind = rng.randrange(9)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 3))]
    if kind == 1:  # truncated frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 2:  # bit flips
        i = rng.randrange(len(frames))
        if frames[i]:
            b = bytearray(frames[i])
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            frames[i] = bytes(b)
    elif kind == 3:  # wrong frame count
        if rng.random() < 0.5 and len(frames) > 1:
            del frames[rng.randrange(1, len(frames))]
        else:
            frames.insert(rng.randint(1, len(frames)), rng.randbytes(rng.randint(0, 16)))
    elif kind == 4:  # frames swapped
        rng.shuffle(frames)
    elif kind in (5, 6):  # edit a field of the decoded header: huge or negative shapes, frame ids, dtypes
        header = msgspec.msgpack.decode(frames[0])
        msg = header[2]
        if msg.get("tensors") and kind == 5:
            ref = rng.choice(msg["tensors"])
            ref["shape"] = [
                rng.choice([0, 1, 3, -1, 2**31, 2**40 + 1, 2**62, 2**64 - 1]) for _ in range(rng.randint(0, 5))
            ]
            ref["frame"] = rng.choice([ref["frame"], 0, -1, 1, 2, 3, 2**63 - 1])
            ref["dtype"] = rng.choice([ref["dtype"], "bool", "uint8", "float64", "", 3])
        else:
            key = rng.choice(list(msg))
            msg[key] = _random_msgpack(rng)
        header[rng.randrange(3)] = header[rng.randrange(3)] if rng.random() < 0.8 else _random_msgpack(rng)
        frames[0] = msgspec.msgpack.encode(header)
    elif kind == 7:  # a random msgpack value as header
        frames[0] = msgspec.msgpack.encode(_random_msgpack(rng))
    elif rng.random() < 0.2:  # random (non-buffer) objects
        frames[rng.randrange(len(frames))] = rng.choice([None, 3, "str", object(), [b"x"]])
    return frames


def test_fuzz_decode_raises_only_protocol_error():
    """10,000 corrupted frame lists (seeded): decode returns a valid message or raises ProtocolError, nothing else."""
    rng = random.Random(1234)
    refs, tensors = pack_tensors([("a", torch.randn(3, 2)), ("b", torch.tensor([True, False])), ("c", torch.empty(0))])
    weights = [bytes(f) for f in encode(WeightsChunk(version=2, index=0, num_chunks=1, tensors=refs), tensors)]
    bases = [([bytes(f) for f in encode(m, seq=i)], ToTrainer) for i, m in enumerate(TO_TRAINER)]
    bases += [([bytes(f) for f in encode(m, seq=i)], ToGenerator) for i, m in enumerate(TO_GENERATOR)]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(10_000):
        frames, union = (weights, ToGenerator) if rng.random() < 0.4 else rng.choice(bases)
        try:
            decode(_mutate(frames, rng), union)
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["error"] += 1
    assert outcomes["error"] > 5_000, outcomes  # the corruption mostly bites


def test_a_token_list_past_the_protocol_limit_is_refused_before_its_elements_are_decoded():
    """msgspec checks a list's length prefix against ``MAX_SEQUENCE_TOKENS`` (declared on the wire
    types) before it decodes an element: a 3M-token resume costs no decoding; at the limit it decodes."""

    from specroll.protocol.limits import MAX_SEQUENCE_TOKENS
    from specroll.protocol.messages import SampleResume, SubmitGroup, ToGenerator
    from specroll.protocol.sampling import SamplingParams

    def submit(tokens: int) -> list:
        resume = SampleResume(index=0, token_ids=[9] * tokens, logprobs=[-0.5] * tokens, versions=[0] * tokens)
        return encode(SubmitGroup(group_id="g", prompt_token_ids=[1], n=1, sampling=SamplingParams(),
                                  resume=(resume,)), session=1, seq=0)

    frames = submit(3_000_000)
    with pytest.raises(ProtocolError, match=rf"length <= {MAX_SEQUENCE_TOKENS} - at `.*resume\[0\]\.token_ids`"):
        decode(frames, ToGenerator)
    assert len(decode(submit(MAX_SEQUENCE_TOKENS), ToGenerator).msg.resume[0].token_ids) == MAX_SEQUENCE_TOKENS
