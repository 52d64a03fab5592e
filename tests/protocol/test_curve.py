"""CURVE security (``network.security = "curve"``; the keys on disk: test_curve_keys.py): refusals over real
sockets (no keys, another run's keys, an unknown key, a valid key for the wrong role), the wire
carrying no token in the clear, and a launched CURVE run training exactly like an unsecured one."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers.drafters import run_config
from helpers.launch import assert_nothing_left, children_of, finish, launch, write_config
from helpers.processes import actor_process, generator_process
from helpers.timeouts import guard
from safetensors.torch import load_file
from zmq.utils.monitor import parse_monitor_message

from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.channel import Channel
from specroll.protocol.curve import (
    MECHANISM_MISMATCH,
    ClientKeys,
    ServerKeys,
    init_keys,
)
from specroll.protocol.messages import PROTOCOL_VERSION, Heartbeat, Hello, Refuse, SubmitGroup, ToGenerator, Welcome
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import make_socket

HANG_S = guard(120)  # a hang guard only: every wait below ends on an event


# ---- refusals over real sockets -------------------------------------------------------------------


class RawPeer:
    """A DEALER speaking the protocol by hand, with whatever keys (or none) it was given."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, name: str, keys: ClientKeys | None) -> None:
        self.name = name
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=name.encode(), curve=keys)
        self.channel = Channel(self.sock, ToGenerator, window=64)
        self.received: list[object] = []

    async def hello(self, role: str) -> None:
        """Send ``Hello``; a peer whose handshake never completes cannot (the socket holds it back)."""
        with anyio.move_on_after(0.5):
            await self.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role=role, actor_id=self.name))

    async def read_all(self) -> list[object]:
        """Every message that reached this peer so far (none waits)."""
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            self.received.append((await self.channel.recv()).msg)
        return self.received


def _client_keys(server: ServerKeys, public: bytes, secret: bytes, role: str) -> ClientKeys:
    return ClientKeys(role=role, server_public=server.public, public=public, secret=secret)


async def _until(predicate, what: str) -> None:
    with anyio.fail_after(HANG_S, shield=False):
        while not predicate():
            await anyio.sleep(0.02)
    assert predicate(), what


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_peers_without_the_runs_keys_or_with_the_wrong_roles_key_are_refused_once_each(
        tmp_path: Path, caplog, anyio_backend) -> None:
    init_keys(tmp_path / "run")
    init_keys(tmp_path / "other")
    server = ServerKeys.load(tmp_path / "run")
    public, secret = zmq.curve_keypair()
    generator_keys, drafter_keys = ClientKeys.load(tmp_path / "run", "generator"), ClientKeys.load(tmp_path / "run",
                                                                                                  "drafter")
    caplog.set_level(logging.WARNING)
    ctx = zmq.asyncio.Context()
    async with RolloutClient(heartbeat_timeout_s=60, curve=server) as client:
        try:
            good = RawPeer(ctx, client.endpoint, "good", generator_keys)
            await good.hello("generator")
            bad = {  # name -> (keys, the role its Hello claims)
                "no_keys": (None, "generator"),
                "other_run": (ClientKeys.load(tmp_path / "other", "generator"), "generator"),
                "unknown_key": (_client_keys(server, public, secret, "generator"), "generator"),
                "drafter_key_as_generator": (drafter_keys, "generator"),
                "generator_key_as_drafter": (generator_keys, "drafter"),
            }
            peers = {name: RawPeer(ctx, client.endpoint, name, keys) for name, (keys, _) in bad.items()}
            for name, (_, role) in bad.items():
                await peers[name].hello(role)
            await _until(lambda: good.received or good.sock.get(zmq.EVENTS) & zmq.POLLIN, "good's Welcome")
            await good.read_all()
            assert isinstance(good.received[0], Welcome)
            # the ones whose keys passed the transport got a Refuse for the role; ask twice: logged once
            for name in ("drafter_key_as_generator", "generator_key_as_drafter"):
                await _until(lambda name=name: peers[name].sock.get(zmq.EVENTS) & zmq.POLLIN, f"{name}'s Refuse")
                await peers[name].hello(bad[name][1])
            expected = {"handshake:285212673", f"key:{public.decode()}", "role:drafter:generator",
                        "role:generator:drafter"}
            # the peer without keys: the trainer sees the mechanism mismatch, or — when the peer saw it first
            # and hung up — a handshake cut short; either way once, and the peer does not try again
            mismatch = {"handshake:285212674", "handshake:hung-up"}
            # every refusal seen, and the retrying ones (another run's keys: ~10 reconnects a second) more than once
            await _until(lambda: expected <= client.refusals.seen and client.refusals.seen & mismatch
                         and client.refusals.count >= len(expected) + 6, "every refusal")
            # the run goes on: the good generator gets the prompt, no other peer gets anything but Refuse
            await good.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=4, free_seqs=16))
            await _until(lambda: client.coordinator.generators.get("good") is not None, "good registered")
            group = await client.submit([11, 12, 13], 2, SamplingParams(max_tokens=4))
            await _until(lambda: good.sock.get(zmq.EVENTS) & zmq.POLLIN and good.received.__len__() >= 0, "dispatch")
            while not any(isinstance(m, SubmitGroup) for m in good.received):
                await _until(lambda: good.sock.get(zmq.EVENTS) & zmq.POLLIN, "good's SubmitGroup")
                await good.read_all()
            [submit] = [m for m in good.received if isinstance(m, SubmitGroup)]
            assert submit.group_id == group and submit.prompt_token_ids == [11, 12, 13]
            for name, peer in peers.items():
                got = await peer.read_all()
                if name in ("drafter_key_as_generator", "generator_key_as_drafter"):
                    assert got and all(isinstance(m, Refuse) for m in got), (name, got)
                    assert f"your key is this run's {name.split('_')[0]!r} key" in got[0].reason
                else:
                    assert got == [], (name, got)
            assert set(client.coordinator.generators) == {"good"} and not client.drafters.drafters
        finally:
            ctx.destroy(linger=0)
    lines = [r.getMessage() for r in caplog.records if "(logged once)" in r.getMessage()]
    # one line per refusal, however often it came (a peer that hung up half-way, having found the
    # mismatch first, is one more kind)
    assert len(lines) == len(set(lines)), lines
    assert len(lines) == len(expected) + len(client.refusals.seen & mismatch), lines
    text = "\n".join(lines)
    assert "without CURVE security" in text or "hung up during its handshake" in text, text
    for part in ("made for another server key", f"unknown public key {public.decode()[:8]}",
                 "refused drafter_key_as_generator: its key is the run's 'drafter' key, and it speaks as 'generator'",
                 "refused generator_key_as_drafter: its key is the run's 'generator' key, and it speaks as 'drafter'"):
        assert part in text, (part, text)



@pytest.mark.integration
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("case", ["no_keys", "unknown_key", "drafter_key", "unsecured_trainer"])
async def test_a_refused_generator_process_exits_2_naming_the_cause(tmp_path: Path, tiny_checkpoint, case: str,
                                                                    anyio_backend) -> None:
    """A real generator the trainer refuses — it runs without CURVE, its key is not the run's, its
    key is the run's drafter key, or it runs CURVE against a trainer without — exits 2 with the
    reason, never registered."""
    init_keys(tmp_path / "run")
    keys = tmp_path / "gen-keys"
    keys.mkdir(mode=0o700)
    (keys / "server.key").write_bytes((tmp_path / "run" / "server.key").read_bytes())
    if case == "unknown_key":
        init_keys(tmp_path / "other")
        secret = (tmp_path / "other" / "generator.key_secret").read_bytes()
    else:
        secret = (tmp_path / "run" / "drafter.key_secret").read_bytes()
    (keys / "generator.key_secret").write_bytes(secret)
    for f in keys.iterdir():
        f.chmod(0o600)
    extra = () if case == "no_keys" else ("--keys", str(keys))
    expected = {"no_keys": "disagree on network.security", "unknown_key": "refused our CURVE key",
                "drafter_key": "your key is this run's 'drafter' key",
                "unsecured_trainer": "disagree on network.security"}[case]
    if case == "unsecured_trainer":  # a run key pair, against a trainer without CURVE
        (keys / "generator.key_secret").write_bytes((tmp_path / "run" / "generator.key_secret").read_bytes())
    server = None if case == "unsecured_trainer" else ServerKeys.load(tmp_path / "run")
    async with RolloutClient(heartbeat_timeout_s=60, curve=server) as client:
        with generator_process(client.endpoint, tiny_checkpoint("llama"), tmp_path / "gen.log", *extra) as proc:
            with anyio.fail_after(HANG_S):
                while proc.poll() is None:
                    await anyio.sleep(0.1)
        assert not client.coordinator.generators
    text = (tmp_path / "gen.log").read_text()
    assert proc.returncode == 2, text
    assert expected in text, text



@pytest.mark.integration
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_drafter_trainer_and_a_generator_with_keys_carry_a_drafter_version_over_curve(
        tmp_path: Path, tiny_checkpoint, anyio_backend) -> None:
    """The drafter's whole path under CURVE: rollouts to the drafter trainer, its ``PublishDrafter``,
    the generator's fetch and ``AckDrafter`` — every hop a CURVE client of the trainer's socket."""
    model = tiny_checkpoint("llama")
    init_keys(tmp_path / "keys")
    keys = ("--keys", str(tmp_path / "keys"))
    config = run_config(model, tmp_path / "run")
    async with RolloutClient(heartbeat_timeout_s=HANG_S, curve=ServerKeys.load(tmp_path / "keys")) as client:
        with generator_process(client.endpoint, model, tmp_path / "gen.log", "--speculative", "eagle", *keys), \
                actor_process([sys.executable, "-m", "specroll.actors.drafter_trainer", "--connect", client.endpoint,
                               "--config", str(config), "--actor-id", "drafter-0", *keys], tmp_path / "drafter.log"):
            await client.wait_for_generators(1, timeout=HANG_S)
            with anyio.fail_after(HANG_S):
                while not client.drafters.drafters:
                    await anyio.sleep(0.05)
            prompts = [[5 + i, 17, 33, 2 * i + 40] for i in range(8)]
            sampling = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
            for prompt in prompts:
                await client.submit(prompt, 2, sampling)
            for _ in prompts:
                await client.next_finished(timeout=HANG_S)
            with anyio.fail_after(HANG_S):
                while client.drafters.generator_drafters.get("gen-0", (0, ""))[0] < 1:
                    await anyio.sleep(0.05)
            assert client.drafters.checksums_match()
            assert not client.refusals.count
    log = (tmp_path / "drafter.log").read_text()
    assert "CURVE security: the drafter key pair and the trainer's public key from" in log



def test_the_monitor_attached_by_make_socket_sees_the_first_refused_handshake(tmp_path: Path) -> None:
    """A refused handshake is reported once and not retried (a mechanism mismatch): a monitor
    attached after the connect may miss it, so ``make_socket`` attaches it before."""
    init_keys(tmp_path / "keys")
    ctx = zmq.Context()
    try:
        server = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")  # no CURVE
        client = make_socket(ctx, zmq.DEALER, connect=server.getsockopt_string(zmq.LAST_ENDPOINT),
                             curve=ClientKeys.load(tmp_path / "keys", "generator"),
                             monitor_events=zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        poller = zmq.Poller()
        monitor = client.get_monitor_socket()
        poller.register(monitor, zmq.POLLIN)
        assert poller.poll(HANG_S * 1000), "no handshake event"
        event = parse_monitor_message(monitor.recv_multipart())
        assert (event["event"], event["value"]) == (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, MECHANISM_MISMATCH)
    finally:
        ctx.destroy(linger=0)


# ---- the wire ------------------------------------------------------------------------------------


@contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, bytearray]]:
    """A TCP relay on 127.0.0.1 to ``upstream`` (``tcp://HOST:PORT``) that keeps every byte it relays,
    both ways; yields its endpoint and the bytes."""
    host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    captured = bytearray()
    lock = threading.Lock()
    conns: list[socket.socket] = []
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with lock:
                    captured.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        while not stop.is_set():
            try:
                a, _ = listener.accept()
            except OSError:
                return
            b = socket.create_connection((host, int(port)))
            conns.extend((a, b))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", captured
    finally:
        stop.set()
        listener.close()
        for c in conns:
            c.close()
        thread.join(timeout=guard(5))


@pytest.mark.integration
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("security", ["none", "curve"])
async def test_no_token_crosses_the_wire_in_the_clear_with_curve(tmp_path: Path, tiny_checkpoint, security: str,
                                                                 anyio_backend) -> None:
    model = tiny_checkpoint("llama")
    init_keys(tmp_path / "keys")
    server = ServerKeys.load(tmp_path / "keys") if security == "curve" else None
    keys_flag = ["--keys", str(tmp_path / "keys")] if security == "curve" else []
    prompt = [201, 37, 199, 58, 233, 17, 244, 90, 123, 66]
    async with RolloutClient(heartbeat_timeout_s=60, curve=server) as client:
        with recording_proxy(client.endpoint) as (endpoint, captured), \
                generator_process(endpoint, model, tmp_path / "gen.log", "--stream-every", "64", *keys_flag):
            await client.wait_for_generators(1, timeout=HANG_S)
            await client.submit(prompt, 2, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
            group = await client.next_finished(timeout=HANG_S)
            wire = bytes(captured)
    assert len(wire) > 1000
    samples = [s.token_ids for s in group.samples]  # each streamed in one chunk (--stream-every 64)
    # the token lists as msgpack puts them on the wire (the elements after the array header)
    patterns = [msgspec.msgpack.encode(ids)[1:] for ids in (prompt, *samples)]
    found = [p in wire for p in patterns]
    if security == "none":
        assert all(found), "the control: plain TCP shows the prompt and the sampled tokens"
    else:
        assert not any(found), found


# ---- a launched run ------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_a_launched_curve_run_trains_exactly_like_an_unsecured_one(tmp_path: Path, tiny_checkpoint) -> None:
    model = tiny_checkpoint()
    before = children_of(os.getpid())
    runs = {}
    for security in ("curve", "none"):
        base = tmp_path / security
        base.mkdir()
        config = write_config(base, model, steps=3, count=1)
        text = config.read_text().replace("[trainer]\n", "[trainer]\nmode = \"sync\"\ncheckpoint_every = 1\n"
                                          "learning_rate = 1e-3\n", 1)
        config.write_text(text.replace("[network]\n", f"[network]\nsecurity = \"{security}\"\n", 1))
        code, out, err = finish(launch(tmp_path, config))
        run_dir = base / "run"
        assert code == 0, err
        assert_nothing_left(run_dir, before)
        runs[security] = run_dir
        if security == "curve":
            assert f"CURVE security: made the run's keys in {run_dir / 'keys'}" in out + err
            assert stat.S_IMODE((run_dir / "keys").stat().st_mode) == 0o700
    metrics = {s: [json.loads(line) for line in (runs[s] / "metrics.jsonl").read_text().splitlines()] for s in runs}
    assert [m["step"] for m in metrics["curve"]] == [1, 2, 3]
    for a, b in zip(metrics["curve"], metrics["none"], strict=True):  # the same rollouts, the same loss
        assert (a["reward_mean"], a["trained_tokens"], a["loss"]) == (b["reward_mean"], b["trained_tokens"], b["loss"])
    weights = {s: load_file(runs[s] / "checkpoint" / "model.safetensors") for s in runs}
    assert all(weights["curve"][k].equal(weights["none"][k]) for k in weights["none"])
