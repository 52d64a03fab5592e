"""Which connected peers (generators, drafter trainers) are alive, as the trainer's client sees them.

A peer is declared gone on either of two grounds:

* **its connection closed** — the socket monitor's ``EVENT_DISCONNECTED`` names a file descriptor,
  and every message says which descriptor it came through (:attr:`Received.fd`), so a closed
  connection maps to the peer that last used it. A killed process's connection closes at once (the
  kernel closes its sockets; ZMTP heartbeats catch a lost host), so its groups resume elsewhere in
  about ``disconnect_grace_s``, not after a heartbeat timeout. The grace, and the rule that only a
  message sent after the close (one read after the receiver drained its queue past the close) clears
  it, keep a live peer safe when a new connection reuses a descriptor number before the monitor's
  event is read, and keep a dead peer's last queued messages from clearing it;
* **silence** — nothing heard for ``timeout_s`` *while the receiver kept up*: silence is measured
  up to the last moment the receive loop found its socket empty, so a trainer whose event loop was
  busy (or starved of CPU) never declares peers dead because it had not read their heartbeats yet.
  A peer that is slow but connected is not dead.

Both grounds move with the clock alone: while it waits, the receive loop reports an empty socket
every quarter second (``Channel.recv(on_idle=...)``), so a lone peer that died — no other peer
sending, nothing arriving at all — is still declared gone (a killed one after the grace, a stopped
one after ``timeout_s``).

A pure state machine: the client feeds it what the receive loop and the monitor see, with times.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Peer:
    last_seen: float
    fd: int | None = None
    closed_at: float | None = None
    """When its connection was seen to close (None: open, or a message since proved it alive)."""


@dataclass
class PeerLiveness:
    """Liveness of the client's peers (module docstring).

    Args:
        timeout_s: seconds of silence (while the receiver keeps up) after which a peer is gone.
        disconnect_grace_s: seconds after its connection closed within which a peer must send a new
            message, or it is gone. Above a peer's heartbeat interval (generators default to 1 s).
    """

    timeout_s: float
    disconnect_grace_s: float = 2.0
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _drained_at: float = 0.0
    """The last time the receive loop found nothing waiting: every message sent before it was read."""

    def add(self, actor: str, now: float, fd: int | None = None) -> None:
        """Start watching ``actor`` (it said ``Hello`` through connection ``fd``)."""
        self._peers[actor] = _Peer(last_seen=now)
        self.heard(actor, fd, now)

    def remove(self, actor: str) -> None:
        """Stop watching ``actor`` (gone, or forgotten)."""
        self._peers.pop(actor, None)

    def __contains__(self, actor: object) -> bool:
        return actor in self._peers

    def heard(self, actor: str, fd: int | None, now: float) -> None:
        """A message from ``actor`` came through connection ``fd`` (None: unknown)."""
        peer = self._peers.get(actor)
        if peer is None:
            return
        peer.last_seen = now
        if peer.closed_at is not None and self._drained_at > peer.closed_at:
            peer.closed_at = None  # sent after the close: a reconnected peer, or a reused descriptor
        if fd is not None and fd != peer.fd:
            for other, p in self._peers.items():  # that descriptor was another peer's: its connection closed
                if other != actor and p.fd == fd:
                    p.fd = None
                    if p.closed_at is None:
                        p.closed_at = now
            peer.fd = fd

    def drained(self, now: float) -> None:
        """The receive loop found its socket empty at ``now``."""
        self._drained_at = now

    def disconnected(self, fd: int, now: float) -> None:
        """The socket monitor reports that connection ``fd`` closed."""
        for peer in self._peers.values():
            if peer.fd == fd:
                peer.fd = None
                if peer.closed_at is None:
                    peer.closed_at = now

    def expired(self, now: float) -> list[tuple[str, str]]:
        """The peers to declare gone now, each with the reason (they stay watched until removed)."""
        gone = []
        for actor, peer in self._peers.items():
            silent = self._drained_at - peer.last_seen
            if peer.closed_at is not None and now - peer.closed_at > self.disconnect_grace_s \
                    and self._drained_at > peer.closed_at:
                gone.append((actor, f"its connection closed {now - peer.closed_at:.1f} s ago"))
            elif silent > self.timeout_s:
                gone.append((actor, f"silent for {silent:.1f} s"))
        return gone
