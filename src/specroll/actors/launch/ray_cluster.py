"""``[cluster] backend = "ray"``: the launcher's side of placing every role on a Ray cluster.

Each role (the trainer, each generator, the drafter trainer) gets one Ray actor,
:class:`~specroll.actors.launch.ray_host.RoleHost`, reserving the role's ``[cluster.<role>]``
``num_cpus`` / ``num_gpus`` on whichever node Ray picks; the actor starts the role's process on its
node (why a child and not the actor itself: ``ray_host.py``). The launcher keeps its own
supervision loop (restarts, back-off, limits, teardown — ``launch.py``, ``supervision.py``, unchanged) over
:class:`RayProcess`, the Popen-like face of that remote process (``role_process.RemoteProcess``):

* start: the actor is created and its ``start`` awaited up to ``cluster.placement_timeout_s`` (a
  role no node can hold fails the launch naming its resources and the cluster's free ones); a
  restart reuses the role's actor — same node, same reserved resources, a process start — unless
  the actor died (its node lost), when a new actor is placed;
* a trainer of ``trainer.world_size`` = N ranks (``rank_roles.py``): one ``STRICT_PACK``
  placement group of N bundles of ``[cluster.trainer]`` resources holds the ranks' actors on one
  node, so their ``--master 127.0.0.1:PORT`` rendezvous works as on one host (the launcher picks
  PORT free on its own host; taken on the ranks' node, the ranks fail and restart on another);
* the trainer's endpoint: its actor reads ``RUN_DIR/trainer.endpoint`` on its node and returns it
  with a wildcard host (``0.0.0.0``) replaced by the node's IP; the launcher passes it to the
  generators' ``--connect``. A trainer bound to a loopback address (the default ``127.0.0.1``) is
  reachable from its own node only, so every other role is then placed on that node (Ray's
  ``NodeAffinitySchedulingStrategy``); spreading roles over nodes needs ``network.host = "0.0.0.0"``
  and ``network.security = "curve"`` (each role's key files travel in its start request, written
  on its node into a private folder: ``ray_host.py``);
* a death: the process's exit code, observed by its actor; an actor that died (``RayActorError``:
  its node lost, its worker killed) is a death by SIGKILL;
* logs stay on the role's node (``RUN_DIR/logs/<role>.log``); where the launcher's host does not
  see that file (no shared filesystem), the tail of the log is copied into the launcher's
  ``RUN_DIR/logs/<role>.log`` at each death, so failure reports show it;
* teardown: the launcher's SIGTERM / grace / SIGKILL / reap go through the actors; then every actor
  is stopped and ``ray.kill``-ed, and ``ray.shutdown()`` (which stops the Ray instance when the
  launcher started it: ``cluster.address`` unset). An actor is owned by the launcher's driver, so
  Ray kills it when the launcher dies, and its role dies with it (``PR_SET_PDEATHSIG``).

Ray serializes what its calls carry with pickle; what specroll sends is msgpack ``bytes``
(``protocol/placement_messages.py``) and plain ints and strings. A Ray cluster runs whatever its
members submit: keep it on a trusted network (Ray's own security guidance).

Each role is a fresh interpreter on its node (``[launch] fork_roles`` does not apply: the launcher
starts no role itself).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.rank_roles import RANK_ROLE_PREFIX, TRAINER_ROLE, is_trainer_rank
from specroll.actors.launch.ray_process import CALL_TIMEOUT_S, RayProcess
from specroll.actors.launch.role_process import RoleProcess
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.protocol.curve import files_for
from specroll.protocol.placement_messages import RoleSpec, RoleStarted

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig
    from specroll.actors.config.cluster_section import RoleResources

_LOOPBACK_HOSTS = ("127.", "localhost", "[::1]")


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        LaunchError: (exit 2) ray is not installed.
    """
    try:
        import ray
    except ImportError as e:
        raise LaunchError(f"cluster.backend = 'ray' needs the ray package ({e}); install it with "
                          f"pip install 'specroll[ray]'", code=EXIT_REFUSED) from e
    return ray


def check_supported(config: RunConfig) -> None:
    """Refuse what Ray cannot place: trainer ranks that reserve nothing (a placement group's bundle
    needs a CPU or a GPU).

    Raises:
        LaunchError: (exit 2) ``trainer.world_size`` > 1 with ``[cluster.trainer]`` reserving 0 CPU and 0 GPU.
    """
    world, res = config.trainer.world_size, config.cluster.trainer
    if world > 1 and not _bundle(res):
        raise LaunchError(f"cluster.trainer.num_cpus={res.num_cpus:g} and num_gpus={res.num_gpus:g} with "
                          f"trainer.world_size={world}, expected a CPU or a GPU per rank (the ranks are packed "
                          f"on one node by reserving them)", code=EXIT_REFUSED)


def _bundle(res: RoleResources) -> dict[str, float]:
    """A placement-group bundle of ``res`` (Ray refuses zero amounts)."""
    return {kind: amount for kind, amount in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if amount > 0}


def _rank(role: str) -> int:
    """The rank of trainer rank role ``role`` (``trainer``: 0, ``trainer-rank<r>``: r)."""
    return 0 if role == TRAINER_ROLE else int(role.removeprefix(RANK_ROLE_PREFIX))


def with_ray_threads(config: RunConfig) -> RunConfig:
    """``config`` with the torch threads left unset taken from the Ray resources of each role (on a CPU
    run): ``trainer.train_threads`` = a trainer rank's ``num_cpus`` and ``generator.engine.num_threads``
    = a generator's, rounded up; ``trainer.borrow_threads`` 0 when unset (the generators may be on
    other nodes). Replaces the local launcher's budget (``cpu_budget.py``), which counts this host's cores."""
    engine, cluster = config.generator.engine, config.cluster
    if engine.device != "cpu":
        return config
    return msgspec.structs.replace(
        config,
        trainer=msgspec.structs.replace(
            config.trainer, train_threads=config.trainer.train_threads or max(1, math.ceil(cluster.trainer.num_cpus)),
            borrow_threads=config.trainer.borrow_threads or 0),
        generator=msgspec.structs.replace(config.generator, engine=msgspec.structs.replace(
            engine, num_threads=engine.num_threads or max(1, math.ceil(cluster.generator.num_cpus)))),
    )


def resources_line(config: RunConfig) -> str:
    """What each role reserves on the Ray cluster, in one line for the launcher's output."""
    cluster = config.cluster

    def role(res: RoleResources, threads: int | None) -> str:
        return f"{res.num_cpus:g} CPU {res.num_gpus:g} GPU" + (f" ({threads} thread(s))" if threads else "")

    drafter = f", the drafter trainer {role(cluster.drafter, config.drafter.num_threads)}" \
        if config.runs_drafter_trainer() else ""
    ranks = f" x {config.trainer.world_size} ranks (one node)" if config.trainer.world_size > 1 else ""
    return (f"Ray resources: trainer {role(cluster.trainer, config.trainer.train_threads)}{ranks}, "
            f"{config.generator.count} generator(s) x {role(cluster.generator, config.generator.engine.num_threads)}"
            f"{drafter}")


@dataclass
class RayCluster:
    """The Ray side of one launch: joins (or starts) Ray, places each role's actor, tears down.

    Args:
        config: the run config (``[cluster]``, and the roles for the local Ray's size).
        say: where status lines go (the launcher's).
        endpoint_file: ``RUN_DIR/trainer.endpoint``: removed on the trainer's node before its first start.
    """

    config: RunConfig
    say: Callable[[str], None]
    endpoint_file: Path
    hosts: dict[str, Any] = field(default_factory=dict, init=False)
    """Every role's actor by role name (a restart reuses it)."""
    processes: dict[str, RayProcess] = field(default_factory=dict, init=False)
    _ray: Any = field(default=None, init=False, repr=False)
    _pin_node: str | None = field(default=None, init=False, repr=False)
    """Node id every other role is placed on: the trainer's, when it bound a loopback address."""
    _trainer_group: Any = field(default=None, init=False, repr=False)
    """The ``STRICT_PACK`` placement group of the trainer's ranks (``trainer.world_size`` > 1)."""

    def connect(self) -> None:
        """Join ``cluster.address``, or start a Ray instance on this host when it is unset (as many
        CPUs as this host's cores or as the roles reserve, whichever is more).

        Raises:
            LaunchError: ray is missing (exit 2), or the cluster cannot be joined.
        """
        if self._ray is not None:
            return
        ray = import_ray()
        address = self.config.cluster.address
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        if address is None:
            kwargs.update(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(self._reserved_cpus())))
        else:
            kwargs.update(address=address)
        previous = signal.getsignal(signal.SIGTERM)  # ray.init installs its own: keep the launcher's
        try:
            ray.init(**kwargs)
        except Exception as e:
            raise LaunchError(f"cluster.address={address!r}: cannot {'start' if address is None else 'join'} "
                              f"Ray ({type(e).__name__}: {e}); expected a running cluster (ray start --head) "
                              f"and its address: auto, HOST:PORT or ray://HOST:PORT", code=EXIT_REFUSED) from e
        finally:
            signal.signal(signal.SIGTERM, previous)
        self._ray = ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        what = "started a local Ray instance" if address is None else f"joined the Ray cluster at {address}"
        self.say(f"{what}: {len(nodes)} node(s), {ray.cluster_resources().get('CPU', 0):g} CPU(s), "
                 f"{ray.cluster_resources().get('GPU', 0):g} GPU(s)")

    def _reserved_cpus(self) -> float:
        cluster, config = self.config.cluster, self.config
        drafter = cluster.drafter.num_cpus if config.runs_drafter_trainer() else 0.0
        generators = config.generator.count * cluster.generator.num_cpus
        return config.trainer.world_size * cluster.trainer.num_cpus + generators + drafter

    def start(self, name: str, module_args: list[str], log_path: Path, check: Callable[[], None]) -> RoleProcess:
        """Start role ``name`` (``python -m module_args...``) on its actor, placing the actor first
        when the role has none (or its actor died); ``check`` is called while waiting (it raises to
        stop waiting: a signal to the launcher).

        Raises:
            LaunchError: no node could hold the role within ``cluster.placement_timeout_s``, or its
                process could not be started there.
        """
        self.connect()
        ray = self._ray
        previous = self.processes.get(name)
        if previous is not None and previous.lost is not None:
            ray.kill(self.hosts.pop(name), no_restart=True)
        first = name not in self.hosts
        if first:
            if is_trainer_rank(name) and self.config.trainer.world_size > 1 and self._trainer_group is None:
                self._trainer_group = self._pack_trainer(check)
            self.hosts[name] = self._place(name)
        config_path = Path(module_args[module_args.index("--config") + 1]).resolve()
        spec = RoleSpec(name=name, module_args=tuple(module_args), cwd=os.getcwd(), log_path=str(log_path.resolve()),
                        config_path=str(config_path), config_text=config_path.read_text(),
                        stale_files=(str(self.endpoint_file.resolve()),) if first and name == "trainer" else (),
                        key_files=self._key_files(name, module_args[0]))
        res = self.config.cluster.resources_of(name)
        pinned = " on the trainer's node (its endpoint is a loopback address)" \
            if self._pin_node is not None and not is_trainer_rank(name) else ""
        failure = f"{name}: no Ray node could hold num_cpus={res.num_cpus:g} num_gpus={res.num_gpus:g}{pinned}"
        reply = self._wait(self.hosts[name].start.remote(msgspec.msgpack.encode(spec)), check, failure,
                           lambda: ray.kill(self.hosts.pop(name), no_restart=True))
        try:
            started = msgspec.msgpack.decode(ray.get(reply), type=RoleStarted)
        except ray.exceptions.RayError as e:
            raise LaunchError(f"{name}: its process could not be started on its Ray node: {e}") from e
        # another node, and no shared filesystem (a restart's log here is the copy its first start made)
        mirror = previous.mirror_log if previous is not None else not log_path.exists()
        if mirror and not log_path.exists():
            log_path.write_text(f"==== specroll launch: {name} runs on {started.hostname} ({started.node_ip}); its "
                                f"log is there, at {log_path.resolve()}; the tails below are copied at each exit\n")
        proc = RayProcess(name, self.hosts[name], started, log_path, mirror)
        self.processes[name] = proc
        return RoleProcess(name, proc, log_path)

    def _place(self, name: str) -> Any:
        """A new :class:`RoleHost` actor for role ``name`` with its resources: a trainer rank in its
        bundle of the ranks' placement group; another role beside the trainer when the trainer bound
        a loopback address; else wherever Ray finds room."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from specroll.actors.launch.ray_host import RoleHost

        resources = self.config.cluster.resources_of(name)
        options: dict[str, Any] = dict(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_restarts=0)
        if is_trainer_rank(name) and self._trainer_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._trainer_group, placement_group_bundle_index=_rank(name))
        elif self._pin_node is not None and not is_trainer_rank(name):
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=self._pin_node, soft=False)
        return self._ray.remote(RoleHost).options(**options).remote()

    def _pack_trainer(self, check: Callable[[], None]) -> Any:
        """The ready ``STRICT_PACK`` placement group of ``trainer.world_size`` bundles of ``[cluster.trainer]``."""
        from ray.util.placement_group import placement_group, remove_placement_group

        world, bundle = self.config.trainer.world_size, _bundle(self.config.cluster.trainer)
        group = placement_group([bundle] * world, strategy="STRICT_PACK")
        self._wait(group.ready(), check, f"trainer: no Ray node could hold its {world} ranks together "
                   f"({world} x {bundle}, STRICT_PACK)", lambda: remove_placement_group(group))
        return group

    def _wait(self, ref: Any, check: Callable[[], None], failure: str, give_up: Callable[[], None]) -> Any:
        """``ref`` once it is ready (a placement takes this), within ``cluster.placement_timeout_s``;
        ``check`` is called meanwhile.

        Raises:
            LaunchError: ``failure``, with the cluster's free resources, after ``give_up()``.
        """
        ray, timeout = self._ray, self.config.cluster.placement_timeout_s
        deadline = time.monotonic() + timeout
        while not ray.wait([ref], timeout=0.2)[0]:
            check()
            if time.monotonic() > deadline:
                give_up()
                raise LaunchError(f"{failure} within {timeout:g} s (cluster.placement_timeout_s); free now: "
                                  f"{ray.available_resources()}")
        return ref

    def describe(self, proc: RoleProcess) -> str:
        """``"on node 10.0.0.5 (gpu-3), Ray actor: 1 CPU, 1 GPU"`` for the launcher's start line."""
        remote = self.processes[proc.name]
        res = self.config.cluster.resources_of(proc.name)
        return (f"on node {remote.started.node_ip} ({remote.started.hostname}), Ray actor: {res.num_cpus:g} CPU, "
                f"{res.num_gpus:g} GPU")

    def endpoint(self, trainer: RoleProcess, path: Path) -> str:
        """The trainer's endpoint as the other roles reach it (``""`` until it is written): read on the
        trainer's node; a loopback one pins every other role to that node (module docstring)."""
        remote = self.processes[trainer.name]
        try:
            text = str(remote.call("endpoint", str(path.resolve())))
        except self._ray.exceptions.RayTaskError as e:  # the file holds no endpoint
            raise LaunchError(f"the trainer's endpoint on {remote.started.node_ip}: {e.cause}") from e
        except self._ray.exceptions.RayError:
            return ""  # the actor is gone or slow: its death is observed by the caller
        if text and text.removeprefix("tcp://").startswith(_LOOPBACK_HOSTS) and self._pin_node is None:
            self._pin_node = remote.started.node_id
            if len([n for n in self._ray.nodes() if n.get("Alive")]) > 1:
                self.say(f"note: the trainer listens on {text} (a loopback address), so every role is placed on its "
                         f"node {remote.started.node_ip}; set network.host = '0.0.0.0' and network.security = "
                         f"'curve' to use the other nodes")
        return text

    def _key_files(self, name: str, module: str) -> dict[str, bytes]:
        """The key files role ``name`` (running ``python -m module``) reads (CURVE), read from the
        launcher's keys folder: they travel in its start request (msgpack bytes over Ray's own
        channel) to a private folder on its node."""
        net = self.config.network
        if net.security != "curve":
            return {}
        if is_trainer_rank(name):
            kind = "trainer" if name == "trainer" else None  # ranks above 0 open no ZeroMQ socket
        else:
            kind = "drafter" if module.endswith(".drafter_trainer") else "generator"
        if kind is None:
            return {}
        directory = net.keys_path(self.config.run_dir)
        return {f: (directory / f).read_bytes() for f in files_for(kind)}

    def close(self) -> None:
        """Stop every role's process group, ``ray.kill`` every actor, ``ray.shutdown()`` (which stops a
        Ray instance this launch started). Safe to call twice."""
        ray = self._ray
        if ray is None:
            return
        for name, host in self.hosts.items():
            try:
                ray.get(host.stop.remote(), timeout=CALL_TIMEOUT_S)
                ray.get(host.forget_keys.remote(), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                if not isinstance(e, ray.exceptions.RayActorError):
                    self.say(f"{name}: its Ray actor did not stop its process ({type(e).__name__}); killing the actor")
            ray.kill(host, no_restart=True)
        self.hosts.clear()
        if self._trainer_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._trainer_group)
            self._trainer_group = None
        ray.shutdown()
        self._ray = None
