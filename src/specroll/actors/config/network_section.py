"""``[network]``: where the trainer listens and how the channels and the weights transport behave."""

from __future__ import annotations

import ipaddress
import math
from pathlib import Path
from typing import Literal

from specroll.actors.config.section import MAX_SECONDS
from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.section import require_seconds as _require_seconds
from specroll.actors.peer.endpoint import check_endpoint
from specroll.protocol.curve import KEYS_DIRNAME, ClientKeys, ServerKeys


class NetworkConfig(_Section):
    """Where the trainer listens and how the channels behave (``[network]``)."""

    host: str = "127.0.0.1"
    """Address the trainer binds and generators connect to. Default ``127.0.0.1``; a non-loopback
    address needs ``security = "curve"`` (or ``allow_insecure``)."""
    trainer_port: int = 0
    """TCP port of the trainer; 0 (default) picks a free one (``specroll launch`` passes it on)."""
    peer_endpoint: str = ""
    """The endpoint ``specroll launch`` tells the generators and the drafter trainer to connect to
    instead of the trainer's own, ``tcp://HOST:PORT``: a relay that forwards to the trainer's port (a
    TCP proxy, an SSH tunnel, a load balancer; ``bench_chaos.py --network`` puts a fault-injecting
    one there). Needs a fixed ``trainer_port``, the port the relay forwards to. Empty (default):
    the trainer's endpoint."""
    security: Literal["none", "curve"] = "none"
    """``curve``: the trainer's endpoint is a ZeroMQ CURVE server (every frame encrypted and
    authenticated) that admits only this run's generator and drafter keys (``keys_dir``), and a
    key's role must be the role its ``Hello`` names (``protocol/curve.py``). ``none`` (default):
    plain TCP, for loopback runs."""
    keys_dir: str = ""
    """The run's keys with ``security = "curve"`` (``specroll keys init``; ``~`` is expanded); empty (default):
    ``RUN_DIR/keys``, which ``specroll launch`` makes on its first start. Roles started by hand on
    other hosts take ``--keys DIR``."""
    allow_insecure: bool = False
    """Allow binding a non-loopback address with ``security = "none"``: anyone who reaches the port
    can join as a generator (and feed training fabricated rollouts), read the policy's weights or
    publish a drafter. Default false; a warning is printed when it is used."""
    hwm: int = 1000
    """ZeroMQ high-water mark: messages queued per peer and direction, 1 to 1,000,000. Default 1000
    (``protocol.sockets.DEFAULT_HWM``)."""
    window: int = 64
    """Credit window: data messages a sender may have unconsumed at one receiver; below ``hwm``.
    Default 64 (``protocol.channel.DEFAULT_WINDOW``)."""
    heartbeat_timeout_s: float = 10.0
    """Seconds of silence (while the trainer keeps up reading) after which a peer is declared dead;
    above ``generator.heartbeat_s``. A peer whose connection closes is declared dead within about 2 s
    without waiting for it. A generator also waits this long for a trainer that said it is exiting
    to come back, and for the handshake. At most 86400. Default 10.0."""
    reconnect_timeout_s: float | None = None
    """Seconds a generator or the drafter trainer waits for a trainer that vanished without saying
    it is exiting (it crashed; ``specroll launch`` restarts it from its checkpoint, on the same port)
    to come back, before it exits with code 3; at least ``heartbeat_timeout_s``, at most a week. Default (unset): the
    larger of 60 and ``heartbeat_timeout_s`` (:meth:`reconnect_s`)."""
    weights_transport: Literal["zmq", "collective"] = "zmq"
    """How policy weights reach the generators: ``zmq`` (default; chunks on the trainer's socket, the
    fallback that works across any network) or ``collective`` (each generator joins a torch.distributed
    group of its own with the trainer and receives every version as bucketed broadcasts, NCCL or gloo;
    announcements and acknowledgements stay on ZeroMQ, the drafter trainer keeps fetching chunks). The
    announcement and the group's address travel on the trainer's channel (encrypted and authenticated
    with ``security = "curve"``), but torch.distributed has no authentication or encryption: the
    groups' stores and sockets bind ``host`` and accept whoever connects, so ``collective`` needs a
    cluster-internal network (``zmq`` is the choice where that cannot be assured)."""
    weights_bucket_mb: int = 64
    """MiB per broadcast with ``collective`` (each bucket is checksummed with CRC-32), 1 to 16384. Default 64."""
    weights_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the weights groups: ``auto`` (default) is NCCL when the trainer trains on CUDA
    (``trainer.device``) and the generator's engine is on CUDA (distinct GPUs: NCCL refuses two
    ranks on one device), else gloo."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require_count("weights_bucket_mb", self.weights_bucket_mb, 1, 16384)
        _require(bool(self.host), "host", self.host, "an address")
        _require(not _looks_numeric(self.host) or _is_ip(self.host), "host", self.host,
                 "a valid IP address, a host name or an interface name")
        _require(self.public_bind_allowed() or _is_loopback(self.host), "host", self.host,
                 "a loopback address (127.0.0.1, ::1, localhost) unless security = 'curve' (or allow_insecure = true: "
                 "then anyone who reaches the port can join the run)")
        _require(0 <= self.trainer_port <= 65535, "trainer_port", self.trainer_port, "a port in [0, 65535]")
        _require(not self.peer_endpoint or _is_endpoint(self.peer_endpoint), "peer_endpoint", self.peer_endpoint,
                 "tcp://HOST:PORT (a port in [1, 65535]) or ipc://PATH, or empty for the trainer's own endpoint")
        _require(not self.peer_endpoint or self.trainer_port != 0, "trainer_port", self.trainer_port,
                 f"a fixed port with peer_endpoint = {self.peer_endpoint!r} (the port the relay forwards to)")
        _require(self.keys_dir == self.keys_dir.strip() and "\0" not in self.keys_dir, "keys_dir", self.keys_dir,
                 "a directory path without leading or trailing spaces (empty: RUN_DIR/keys)")
        _require_count("hwm", self.hwm, 1, 1_000_000)
        _require(2 <= self.window < self.hwm, "window", self.window, f"an integer in [2, hwm = {self.hwm})")
        _require_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s, 86400)
        r = self.reconnect_timeout_s
        _require(r is None or (math.isfinite(r) and self.heartbeat_timeout_s <= r <= MAX_SECONDS),
                 "reconnect_timeout_s", r,
                 f"a number of seconds in [heartbeat_timeout_s = {self.heartbeat_timeout_s}, {MAX_SECONDS:g}]")

    def public_bind_allowed(self) -> bool:
        """A non-loopback ``host`` is allowed: CURVE security, or ``allow_insecure``."""
        return self.security == "curve" or self.allow_insecure

    def insecure_warning(self) -> str | None:
        """The warning a public endpoint without security deserves (None for loopback or CURVE)."""
        if self.security == "curve" or _is_loopback(self.host):
            return None
        return (f"network.host = {self.host!r} with security = 'none' (allow_insecure = true): nothing is "
                "authenticated or encrypted; anyone who reaches the trainer's port can join as a generator and feed "
                "training fabricated rollouts, read the policy's weights, or publish a drafter; set "
                "network.security = 'curve'")

    def keys_path(self, run_dir: str) -> Path:
        """``keys_dir`` (``~`` expanded), or ``RUN_DIR/keys`` when it is empty."""
        return Path(self.keys_dir).expanduser() if self.keys_dir else Path(run_dir) / KEYS_DIRNAME

    def curve_keys(self, run_dir: str, role: str) -> ServerKeys | ClientKeys | None:
        """The keys ``role`` (``trainer``, ``generator``, ``drafter``) runs with: None without CURVE.

        Raises:
            KeysError: a key file is missing, unreadable, readable by others or malformed (the
                message names it); checked before any socket opens.
        """
        return self.server_keys(run_dir) if role == "trainer" else self.client_keys(run_dir, role)

    def server_keys(self, run_dir: str) -> ServerKeys | None:
        """The trainer's keys (:meth:`curve_keys`)."""
        return ServerKeys.load(self.keys_path(run_dir)) if self.security == "curve" else None

    def client_keys(self, run_dir: str, role: str) -> ClientKeys | None:
        """A generator's or drafter trainer's keys (:meth:`curve_keys`)."""
        return ClientKeys.load(self.keys_path(run_dir), role) if self.security == "curve" else None

    def reconnect_s(self) -> float:
        """``reconnect_timeout_s``, or when unset the larger of 60 s and ``heartbeat_timeout_s``."""
        return self.reconnect_timeout_s if self.reconnect_timeout_s is not None else max(60.0, self.heartbeat_timeout_s)


def _is_endpoint(text: str) -> bool:
    try:
        check_endpoint(text)
    except ValueError:
        return False
    return True


def _looks_numeric(host: str) -> bool:
    """An IPv4 literal's alphabet (digits and dots): meant as an address, not a name."""
    return all(c.isdigit() or c == "." for c in host)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # a hostname, an interface name or "*": public


