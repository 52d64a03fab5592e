"""What the hub's holders export (the trainer and ``specroll serve``: the generators registered and
lost, the messages refused) and the OpenAI-compatible server's request counts — read at scrape
time."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import Metric

from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.families import family, role_families

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


def collect_hub(client: RolloutClient, role: str, actor_id: str) -> Iterator[Metric]:
    """The hub's families: generators alive and dead, ``Error`` replies by code, the role's identity."""
    yield family(c.GENERATORS, [((), len(client.coordinator.generators))])
    yield family(c.GENERATOR_DEATHS, [((), len(client.dead_generators))])
    yield from role_families(client.mail.errors_sent, role, actor_id)


def collect_server(router: RouterState) -> Iterator[Metric]:
    """The OpenAI-compatible server's families: requests accepted, rejected, in flight; pause; sessions."""
    yield family(c.SERVER_REQUESTS, [((), router.requests_total)])
    yield family(c.SERVER_REJECTED, [((), router.rejected_total)])
    yield family(c.SERVER_IN_FLIGHT, [((), router.num_in_flight)])
    yield family(c.SERVER_PAUSED, [((), int(router.paused))])
    yield family(c.SERVER_SESSIONS, [((), len(router.sessions))])
