"""What the hub's holders export (the trainer and ``specroll serve``: the generators registered and
lost, the messages refused, the groups dropped by the retry rule) and the OpenAI-compatible server's
request counts — read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import Metric

from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.families import family, role_families
from specroll.rl.group_retries import DROP_REASONS

if TYPE_CHECKING:
    from specroll.actors.rollout.client import RolloutClient


class RouterState(Protocol):
    """What a scrape reads of the server's router (``actors/server/requests.Router`` has it)."""

    requests_total: int
    rejected_total: int
    paused: bool
    sessions: Sized

    @property
    def num_in_flight(self) -> int: ...


def collect_hub(client: RolloutClient, role: str, actor_id: str,
                dropped: Mapping[str, int] | None = None) -> Iterator[Metric]:
    """The hub's families: generators alive and dead, groups dropped by reason (the hub's, plus
    ``dropped``: those its holder dropped itself, episode groups), ``Error`` replies by code, the
    role's identity."""
    yield family(c.GENERATORS, [((), len(client.coordinator.generators))])
    yield family(c.GENERATOR_DEATHS, [((), len(client.dead_generators))])
    hub, more = dict(client.coordinator.groups_dropped), dict(dropped or {})
    yield family(c.GROUPS_DROPPED, [((r,), hub.get(r, 0) + more.get(r, 0)) for r in DROP_REASONS])
    yield from role_families(client.mail.errors_sent, role, actor_id)


def collect_server(router: RouterState) -> Iterator[Metric]:
    """The OpenAI-compatible server's families: requests accepted, rejected, in flight; pause; sessions."""
    yield family(c.SERVER_REQUESTS, [((), router.requests_total)])
    yield family(c.SERVER_REJECTED, [((), router.rejected_total)])
    yield family(c.SERVER_IN_FLIGHT, [((), router.num_in_flight)])
    yield family(c.SERVER_PAUSED, [((), int(router.paused))])
    yield family(c.SERVER_SESSIONS, [((), len(router.sessions))])
