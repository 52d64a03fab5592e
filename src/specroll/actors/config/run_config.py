"""Run configuration: strict structs for a whole run, loaded from TOML with ``--set a.b=value`` overrides.

One :class:`RunConfig` describes everything ``specroll launch`` starts (trainer, generators,
drafter trainer) and every role started alone reads the same file. ``RunConfig()`` is a small valid
run on a CPU: the default model, the built-in arithmetic task, one generator. It nests one struct
per section, each in a module of its own: ``[model]`` (``model_section.py``), ``[task]`` and ``[eval]``
(``task_section.py``), ``[trainer]`` (``trainer_section.py``), ``[generator]``
(``generator_section.py``), ``[drafter]`` (``drafter_section.py``), ``[network]``
(``network_section.py``), ``[launch]`` (``launch_section.py``), ``[cluster]`` (``cluster_section.py``),
``[server]`` (``server_section.py``), ``[metrics]`` (``metrics_section.py``);
this module holds the run's own keys and the checks that span sections.

* :func:`~specroll.actors.config.load.load_config` reads a file (or nothing: the defaults), applies
  overrides and validates (reading, overrides and error messages: ``parse.py``).
* :func:`~specroll.actors.config.dump.dump_config` writes TOML;
  :func:`~specroll.actors.config.dump.write_resolved` writes ``RUN_DIR/config.toml`` atomically, and
  ``load_config(write_resolved(c, d)) == c`` (``dump.py``, which imports this module; the package
  ``specroll.actors.config`` re-exports both).
* Every problem is one :class:`~specroll.actors.config.errors.ConfigError` naming the file, the
  dotted key and what was expected.

Every struct is frozen and forbids unknown fields; ranges are checked in ``__post_init__`` (which
raises ``ValueError`` naming the field, the value and what was expected), so a config built in code
is checked exactly like one loaded from a file. An optional field always defaults to ``None``: TOML
has no null, so :func:`dump_config` omits ``None`` and the round trip relies on it.

Layering: the generator section nests :class:`~specroll.engine.config.EngineConfig` and the drafter
section builds the drafter layer's :class:`~specroll.drafter.learner.LearnerConfig`
(:meth:`DrafterConfig.learner_config`), so the run configuration lives in ``actors/`` (which may
import every layer) rather than in ``protocol/``, which stays a leaf.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from specroll.actors.config.cluster_section import ClusterConfig
from specroll.actors.config.drafter_section import DrafterConfig
from specroll.actors.config.generator_section import GeneratorConfig
from specroll.actors.config.launch_section import LaunchConfig
from specroll.actors.config.metrics_section import MetricsConfig
from specroll.actors.config.model_section import ModelSection
from specroll.actors.config.network_section import NetworkConfig
from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.server_section import ServerConfig
from specroll.actors.config.task_section import EvalConfig, TaskConfig
from specroll.actors.config.trainer_section import TrainerConfig
from specroll.engine.loaders.registry import DEFAULT_MODEL

MAX_STEPS = 10_000_000
"""The most GRPO steps a run may ask for (``steps``)."""


class RunConfig(_Section):
    """A whole run: ``specroll launch`` and every role read it. ``RunConfig()`` is a small CPU run."""

    run_dir: str = "runs/default"
    """Directory of the run: resolved config, metrics JSONL, checkpoints. Default ``runs/default``."""
    seed: int = 0
    """Seed of the run: prompt order, per-request sampling seeds, initialisation. Default 0."""
    steps: int = 3
    """GRPO steps to train, 1 to 10,000,000. Default 3."""
    model: ModelSection = ModelSection()
    task: TaskConfig = TaskConfig()
    trainer: TrainerConfig = TrainerConfig()
    generator: GeneratorConfig = GeneratorConfig()
    drafter: DrafterConfig = DrafterConfig()
    network: NetworkConfig = NetworkConfig()
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (``[eval]``)."""
    launch: LaunchConfig = LaunchConfig()
    """Supervision of the processes ``specroll launch`` starts (``[launch]``)."""
    cluster: ClusterConfig = ClusterConfig()
    """Where ``specroll launch`` places the roles: this host, or Ray actors on a cluster (``[cluster]``)."""
    server: ServerConfig = ServerConfig()
    """The OpenAI-compatible HTTP server (``[server]``)."""
    metrics: MetricsConfig = MetricsConfig()
    """Live metrics: Prometheus ``/metrics`` on every role, W&B and TensorBoard sinks (``[metrics]``)."""

    def __post_init__(self) -> None:
        _require(bool(self.run_dir), "run_dir", self.run_dir, "a directory path")
        _require(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        _require_count("steps", self.steps, 1, MAX_STEPS)
        engine = self.generator.engine
        if engine.model != self.model.name:
            # The generators serve the policy: an engine model left at its default follows model.name.
            _require(engine.model == DEFAULT_MODEL, "generator.engine.model", engine.model,
                     f"unset or equal to model.name={self.model.name!r}")
            generator = msgspec.structs.replace(self.generator, engine=msgspec.structs.replace(
                engine, model=self.model.name))
            msgspec.structs.force_setattr(self, "generator", generator)
        _require(self.generator.speculative != "eagle" or self.drafter.enabled or self.drafter.path is not None,
                 "generator.speculative", self.generator.speculative,
                 "'off', 'suffix' or 'auto' unless drafter.enabled = true or drafter.path is set")
        _require(self.network.heartbeat_timeout_s > self.generator.heartbeat_s, "network.heartbeat_timeout_s",
                 self.network.heartbeat_timeout_s, f"more than generator.heartbeat_s = {self.generator.heartbeat_s}")
        server = self.server
        _require(server.is_loopback() or bool(server.api_key) or self.network.allow_insecure, "server.host",
                 server.host, "a loopback address (127.0.0.1, ::1, localhost) unless server.api_key is set (or "
                 "network.allow_insecure = true: then anyone who reaches the port can generate, pause the "
                 "generators and replace the policy's weights)")
        _require(server.max_n <= self.generator.engine.max_num_seqs, "server.max_n", server.max_n,
                 f"at most generator.engine.max_num_seqs = {self.generator.engine.max_num_seqs} (a request's n "
                 "samples run on one generator)")
        tc = self.trainer
        evaluated = self.eval.count if self.eval.every else 0
        served = server.max_requests_in_flight if server.enabled or self.task.environment is not None else 0
        queued = tc.max_groups_in_flight + evaluated + served
        _require(tc.max_queued_groups >= queued, "trainer.max_queued_groups", tc.max_queued_groups,
                 f"at least trainer.max_groups_in_flight + eval.count + server.max_requests_in_flight = "
                 f"{tc.max_groups_in_flight} + {evaluated} + {served} = {queued} (what the trainer, its evaluation "
                 "and its server, when it serves, may queue at once)")
        metrics = self.metrics
        _require(not metrics.enabled or metrics.is_loopback() or bool(metrics.api_key) or self.network.allow_insecure,
                 "metrics.host", metrics.host, "a loopback address (127.0.0.1, ::1, localhost) unless metrics.api_key "
                 "is set (or network.allow_insecure = true: then anyone who reaches the ports reads the run's metrics)")
        last = metrics.port_for(f"generator-{self.generator.count - 1}")
        _require(metrics.port == 0 or last <= 65535, "metrics.port", metrics.port,
                 f"a base port with room for generator.count = {self.generator.count} generators (port + 2 + i "
                 "<= 65535), or 0 for free ports")
        k = engine.num_draft_tokens
        # The acceptance length (tokens per verify step) is at most k + 1: k drafts and a bonus token.
        _require(self.drafter.acceptance_floor <= k + 1, "drafter.acceptance_floor", self.drafter.acceptance_floor,
                 f"at most generator.engine.num_draft_tokens + 1 = {k + 1} (the acceptance length never exceeds "
                 f"k + 1 with k = {k} drafts per step), or 0 to never warn")
        minutes = self.drafter.warm_start_minutes
        _require(not minutes or self.task.environment is None, "drafter.warm_start_minutes", minutes,
                 f"0 with task.environment = {self.task.environment!r} (a warm start samples single-turn responses "
                 "to the task's prompts; an episode's turns come from its environment)")
        _require(not minutes or self.cluster.backend == "local", "drafter.warm_start_minutes", minutes,
                 "0 with cluster.backend = 'ray' (the warm start is cached on the launcher's host; make one with "
                 "'specroll drafter init' on storage every node reads and set drafter.path)")

    def speculative(self) -> Literal["off", "suffix", "eagle"]:
        """``generator.speculative`` with ``auto`` resolved: ``eagle`` when a drafter is configured
        (``drafter.enabled`` or ``drafter.path``), else ``suffix``; ``off`` in ``trainer.mode = "sync"``."""
        mode = self.generator.speculative
        if self.trainer.mode == "sync":
            return "off"
        if mode == "auto":
            return "eagle" if self.drafter.enabled or self.drafter.path is not None else "suffix"
        return mode

    def runs_drafter_trainer(self) -> bool:
        """Whether ``specroll launch`` starts the drafter trainer: ``drafter.enabled``, except in
        ``trainer.mode = "sync"`` (which never speculates)."""
        return self.drafter.enabled and self.trainer.mode == "async"

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what was meant, one line each naming the keys
        (``specroll launch`` and ``specroll drafter serve`` print them at start).

        * ``drafter.enabled`` with ``generator.speculative`` ``off`` or ``suffix``: the drafter trainer
          runs and saves its versions to ``RUN_DIR/drafter`` — a legitimate way to train a drafter for
          a later run's warm start (``drafter.path``) without spending generator time on drafting —
          but no generator drafts with them, which is more often a forgotten ``speculative``.
        * a non-loopback ``network.host`` with ``security = "none"`` (``allow_insecure``): nothing is
          authenticated; the same for ``server.host`` and ``metrics.host`` without a key.
        """
        found = []
        insecure = self.network.insecure_warning()
        if insecure is not None:
            found.append(insecure)
        if not self.server.is_loopback() and not self.server.api_key:
            found.append(f"server.host = {self.server.host!r} without server.api_key (network.allow_insecure = true): "
                         "anyone who reaches the server's port can generate, pause the generators and replace the "
                         "policy's weights; set server.api_key")
        m = self.metrics
        if m.enabled and not m.is_loopback() and not m.api_key:
            found.append(f"metrics.host = {m.host!r} without metrics.api_key (network.allow_insecure = true): anyone "
                         "who reaches the metrics ports reads the run's metrics; set metrics.api_key")
        mode = self.generator.speculative
        if self.runs_drafter_trainer() and mode in ("off", "suffix"):
            found.append(f"drafter.enabled = true with generator.speculative = {mode!r}: the drafter trainer trains "
                         f"and saves drafter versions to {self.run_dir}/drafter, but no generator drafts with them; "
                         f"set generator.speculative = 'auto' (or 'eagle') to draft with them")
        return found

    def served_drafter(self) -> str | None:
        """The drafter directory each generator serves from its first step (``drafter.path`` when
        :meth:`speculative` is ``eagle``), else ``None``."""
        return self.drafter.path if self.speculative() == "eagle" else None
