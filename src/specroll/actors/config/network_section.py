"""``[network]``: where the trainer listens and how the channels and the weights transport behave."""

from __future__ import annotations

import ipaddress
import math
from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require


class NetworkConfig(_Section):
    """Where the trainer listens and how the channels behave (``[network]``)."""

    host: str = "127.0.0.1"
    """Address the trainer binds and generators connect to. Default ``127.0.0.1``; a non-loopback
    address needs ``allow_public``."""
    trainer_port: int = 0
    """TCP port of the trainer; 0 (default) picks a free one (``specroll launch`` passes it on)."""
    allow_public: bool = False
    """Allow binding a non-loopback address. Default false: messages are not authenticated."""
    hwm: int = 1000
    """ZeroMQ high-water mark: messages queued per peer and direction. Default 1000
    (``protocol.sockets.DEFAULT_HWM``)."""
    window: int = 64
    """Credit window: data messages a sender may have unconsumed at one receiver; below ``hwm``.
    Default 64 (``protocol.channel.DEFAULT_WINDOW``)."""
    heartbeat_timeout_s: float = 10.0
    """Seconds of silence (while the trainer keeps up reading) after which a peer is declared dead;
    above ``generator.heartbeat_s``. A peer whose connection closes is declared dead within about 2 s
    without waiting for it. A generator also waits this long for a trainer that said it is exiting
    to come back, and for the handshake. Default 10.0."""
    reconnect_timeout_s: float | None = None
    """Seconds a generator or the drafter trainer waits for a trainer that vanished without saying
    it is exiting (it crashed; ``specroll launch`` restarts it from its checkpoint, on the same port)
    to come back, before it exits with code 3; at least ``heartbeat_timeout_s``. Default (unset): the
    larger of 60 and ``heartbeat_timeout_s`` (:meth:`reconnect_s`)."""
    weights_transport: Literal["zmq", "collective"] = "zmq"
    """How policy weights reach the generators: ``zmq`` (default; chunks on the trainer's socket, the
    fallback that works across any network) or ``collective`` (each generator joins a torch.distributed
    group of its own with the trainer and receives every version as bucketed broadcasts, NCCL or gloo;
    announcements and acknowledgements stay on ZeroMQ, the drafter trainer keeps fetching chunks). The
    groups' stores and sockets bind ``host`` and are unauthenticated: a cluster-internal network only."""
    weights_bucket_mb: int = 64
    """MiB per broadcast with ``collective`` (each bucket is checksummed with CRC-32). Default 64."""
    weights_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the weights groups: ``auto`` (default) is NCCL when the trainer trains on CUDA
    (``trainer.device``) and the generator's engine is on CUDA (distinct GPUs: NCCL refuses two
    ranks on one device), else gloo."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.weights_bucket_mb >= 1, "weights_bucket_mb", self.weights_bucket_mb, "a positive number of MiB")
        _require(bool(self.host), "host", self.host, "an address")
        _require(self.allow_public or _is_loopback(self.host), "host", self.host,
                 "a loopback address (127.0.0.1, ::1, localhost) unless allow_public = true")
        _require(0 <= self.trainer_port <= 65535, "trainer_port", self.trainer_port, "a port in [0, 65535]")
        _require(self.hwm >= 1, "hwm", self.hwm, "a positive integer")
        _require(2 <= self.window < self.hwm, "window", self.window, f"an integer in [2, hwm = {self.hwm})")
        _require(self.heartbeat_timeout_s > 0 and math.isfinite(self.heartbeat_timeout_s), "heartbeat_timeout_s",
                 self.heartbeat_timeout_s, "a positive number of seconds")
        r = self.reconnect_timeout_s
        _require(r is None or (math.isfinite(r) and r >= self.heartbeat_timeout_s), "reconnect_timeout_s", r,
                 f"a number of seconds >= heartbeat_timeout_s = {self.heartbeat_timeout_s}")

    def reconnect_s(self) -> float:
        """``reconnect_timeout_s``, or when unset the larger of 60 s and ``heartbeat_timeout_s``."""
        return self.reconnect_timeout_s if self.reconnect_timeout_s is not None else max(60.0, self.heartbeat_timeout_s)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # a hostname, an interface name or "*": public
