"""``[cluster]``: where ``specroll launch`` places the roles — processes on this host (``local``,
the default) or Ray actors on any node of a Ray cluster (``ray``; ``actors/launch/ray_cluster.py``)."""

from __future__ import annotations

import math
from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_seconds as _require_seconds


def _check_quantity(name: str, value: float) -> None:
    """A Ray resource quantity: finite, >= 0, and a whole number when above 1 (Ray refuses 1.5 GPUs)."""
    _require(math.isfinite(value) and 0 <= value <= 4096, name, value, "a number in [0, 4096]")
    _require(value <= 1 or value == int(value), name, value, "a fraction below 1 or a whole number")


class RoleResources(_Section):
    """The Ray resources one process of a role reserves (``[cluster.trainer]``, ``[cluster.generator]``,
    ``[cluster.drafter]``). Ray schedules the role's actor on a node that has them free and sets
    ``CUDA_VISIBLE_DEVICES`` to the GPUs it reserved, which the role's process inherits."""

    num_cpus: float = 1.0
    """CPUs reserved (Ray's logical ``num_cpus``; a fraction below 1 shares a core). Under
    ``backend = "ray"`` an unset ``trainer.train_threads`` / ``generator.engine.num_threads`` becomes
    this, rounded up. At most 4096. Default 1."""
    num_gpus: float = 0.0
    """GPUs reserved (Ray's ``num_gpus``; a fraction below 1 shares a GPU). Default 0: a CPU role;
    set 1 for a role that runs on CUDA. At most 4096."""

    def __post_init__(self) -> None:
        _check_quantity("num_cpus", self.num_cpus)
        _check_quantity("num_gpus", self.num_gpus)


class ClusterConfig(_Section):
    """Where ``specroll launch`` places the roles (``[cluster]``; ``specroll launch --cluster ray`` sets
    ``backend``). With ``ray`` every role (trainer, each generator, the drafter trainer) is a Ray
    actor reserving its ``[cluster.<role>]`` resources, on any node; the launcher supervises them as
    it does local processes (``[launch]``). A multi-node run needs ``network.host`` routable from the
    other nodes (``"0.0.0.0"`` with ``network.security = "curve"``): with a loopback host every role
    is placed on the trainer's node. ``specroll trainer`` and ``specroll generator`` ignore this section.
    """

    backend: Literal["local", "ray"] = "local"
    """``local`` (default): every role a process of this host. ``ray``: every role a Ray actor
    (needs ``pip install 'specroll[ray]'``)."""
    address: str | None = None
    """The Ray cluster to join (``ray.init(address=...)``): ``"auto"`` (the cluster this host joined
    with ``ray start``), ``"HOST:PORT"`` of the head's GCS, or ``"ray://HOST:10001"`` (Ray Client).
    Unset (default): a Ray instance on this host is started for the launch and stopped at its end."""
    placement_timeout_s: float = 300.0
    """Seconds a role's actor may wait for a node with its resources (and its process to start)
    before the launch fails naming the role and the cluster's free resources; at most 86400. Default 300."""
    trainer: RoleResources = RoleResources()
    """Resources of the trainer: of each rank when ``trainer.world_size`` > 1 (the ranks are packed on
    one node, a ``STRICT_PACK`` placement group, so their ``127.0.0.1`` rendezvous works)."""
    generator: RoleResources = RoleResources()
    """Resources of each generator."""
    drafter: RoleResources = RoleResources()
    """Resources of the drafter trainer."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.address is None or bool(self.address.strip()), "address", self.address,
                 'unset, "auto", "HOST:PORT" or "ray://HOST:PORT"')
        _require_seconds("placement_timeout_s", self.placement_timeout_s, 86400)

    def resources_of(self, role: str) -> RoleResources:
        """The resources of the role named ``role`` (``trainer``, ``trainer-<rank>``, ``generator-<i>``,
        ``drafter``).

        Raises:
            ValueError: a role name of none of these kinds.
        """
        kind = role.partition("-")[0]
        match kind:
            case "trainer":
                return self.trainer
            case "generator":
                return self.generator
            case "drafter":
                return self.drafter
        raise ValueError(f"role {role!r}, expected trainer, trainer-<rank>, generator-<i> or drafter")
