"""The drafter trainer's metrics: its training steps and time, the versions it published and trains
against, its last loss, and the rollouts it received and holds — read at scrape time from the actor
and its learner."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import Metric

from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.families import family, role_families

if TYPE_CHECKING:
    from specroll.drafter.learner import DrafterLearner


class _Peer(Protocol):
    refusals: Counter[str]


class DrafterState(Protocol):
    """What a scrape reads of the drafter trainer (``DrafterActor`` has it)."""

    learner: DrafterLearner
    train_s: float
    last_metrics: dict[str, float]
    rollouts_received: int
    peer: _Peer


def collect_drafter(actor: DrafterState, actor_id: str) -> Iterator[Metric]:
    """The drafter trainer's families at one scrape (the catalogue's ``drafter`` and ``any`` metrics)."""
    learner = actor.learner
    policy = learner.trained_policy_version if learner.trained_policy_version is not None else learner.policy_version
    yield family(c.DRAFTER_STEPS, [((), learner.steps)])
    yield family(c.DRAFTER_TRAIN_SECONDS, [((), actor.train_s)])
    yield family(c.DRAFTER_PUBLISHED, [((), learner.version)])
    yield family(c.DRAFTER_POLICY, [((), policy)])
    yield family(c.DRAFTER_LOSS, [((), actor.last_metrics.get("loss", math.nan))])
    yield family(c.DRAFTER_ROLLOUTS, [((), actor.rollouts_received)])
    yield family(c.DRAFTER_BUFFER, [((), learner.num_rollouts)])
    yield from role_families(actor.peer.refusals, "drafter", actor_id)
