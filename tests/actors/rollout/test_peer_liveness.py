"""The trainer-side liveness rules (``actors/rollout/liveness.py``), without sockets: times are given."""

from __future__ import annotations

from helpers.timeouts import guard

from specroll.actors.rollout.liveness import PeerLiveness


def _live(timeout: float = 10.0, grace: float = 2.0) -> PeerLiveness:
    live = PeerLiveness(timeout, grace)
    live.add("g0", 0.0, fd=7)
    live.add("g1", 0.0, fd=8)
    return live


def test_silence_counts_only_while_the_receiver_keeps_up() -> None:
    live = _live()
    live.drained(5.0)
    assert live.expired(100.0) == []  # the receiver was busy since t=5: unread heartbeats may be waiting
    live.heard("g0", 7, 100.0)  # the backlog read: g0 had sent; g1 had not
    live.drained(100.5)
    assert [a for a, _ in live.expired(100.5)] == ["g1"]
    assert "silent for 100.5 s" in live.expired(100.5)[0][1]


def test_a_closed_connection_ends_a_peer_after_the_grace() -> None:
    live = _live()
    live.disconnected(7, 1.0)
    live.drained(1.5)
    assert live.expired(2.9) == []  # within the grace
    assert [a for a, _ in live.expired(3.1)] == ["g0"]
    assert "connection closed" in live.expired(3.1)[0][1]


def test_messages_queued_before_the_close_do_not_revive_a_dead_peer() -> None:
    live = _live()
    live.disconnected(7, 1.0)
    live.heard("g0", 7, 1.2)  # its last chunk, read after the monitor's event (no drain since the close)
    live.drained(1.3)
    assert [a for a, _ in live.expired(3.5)] == ["g0"]


def test_a_message_sent_after_the_close_keeps_the_peer() -> None:
    # A new connection reused descriptor 8 (g1's, which closed) and the monitor's event came late: the
    # new owner g0 is marked, then its next heartbeat, read after a drain, clears it.
    live = _live()
    live.heard("g0", 8, 1.0)  # g0 reconnected through descriptor 8: g1's connection must have closed
    live.disconnected(8, 1.1)  # the monitor's event for g1's old connection, read late
    live.drained(1.2)
    live.heard("g0", 8, 1.5)
    live.drained(1.6)
    assert [a for a, _ in live.expired(4.0)] == ["g1"]


def test_a_slow_but_connected_peer_is_not_dead() -> None:
    live = _live(timeout=guard(10.0))
    for t in range(0, 60, 9):  # a heartbeat every 9 s, within the timeout
        live.heard("g0", 7, float(t))
        live.heard("g1", 8, float(t))
        live.drained(float(t) + 0.1)
        assert live.expired(float(t) + 0.1) == []


def test_removed_peers_are_not_reported() -> None:
    live = _live()
    live.remove("g0")
    live.drained(50.0)
    assert [a for a, _ in live.expired(50.0)] == ["g1"]
    assert "g0" not in live and "g1" in live


def test_a_descriptor_taken_by_another_peer_means_the_old_connection_closed() -> None:
    live = _live()
    live.heard("g0", 8, 1.0)  # descriptor 8 now carries g0: g1's connection closed (no monitor event needed)
    live.drained(1.1)
    live.heard("g0", 8, 2.5)
    live.drained(3.5)
    assert [a for a, _ in live.expired(3.5)] == ["g1"]


# ---- the peer side: how long a generator waits for its trainer ----------------------------------


def _watch(liveness: object, within: float) -> list[tuple[bool, str]]:
    """Run the watchdog until it reports (or ``within`` seconds pass); what it reported."""
    import anyio

    calls: list[tuple[bool, str]] = []

    async def main() -> None:
        with anyio.move_on_after(within):
            async with anyio.create_task_group() as tg:
                def lost(ended: bool, reason: str) -> None:
                    calls.append((ended, reason))
                    tg.cancel_scope.cancel()

                tg.start_soon(liveness.watchdog, lost)  # type: ignore[attr-defined]

    anyio.run(main)
    return calls


def test_a_trainer_that_vanished_gets_the_reconnect_timeout_and_one_that_ended_the_short_one() -> None:
    import logging
    import time

    from specroll.actors.peer.trainer_liveness import TrainerLiveness

    log = logging.getLogger("test")
    crashed = TrainerLiveness("tcp://127.0.0.1:1", 0.04, log, reconnect_s=3600.0)
    crashed.connected, crashed.last_alive = False, time.monotonic() - 60  # gone a minute, no Dead
    assert _watch(crashed, 0.3) == []  # a restart from its checkpoint may take this long: keep waiting
    crashed.reconnect_s = 30.0
    [(ended, reason)] = _watch(crashed, 60.0)
    assert not ended and "for 30.0 s" in reason
    finished = TrainerLiveness("tcp://127.0.0.1:1", 0.04, log, reconnect_s=3600.0)
    finished.heard(dead=True)
    finished.last_alive = time.monotonic() - 60
    [(ended, reason)] = _watch(finished, 60.0)
    assert ended and "ended and did not come back" in reason
