"""``[generator]``: the generators — each generator's engine (``[generator.engine]``, the engine
layer's own :class:`~specroll.engine.config.EngineConfig`), how rollouts are sampled
(``[generator.sampling]``), streaming, heartbeats and speculative decoding."""

from __future__ import annotations

import math
from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.engine.config import EngineConfig
from specroll.protocol.sampling import SamplingParams


class GeneratorConfig(_Section):
    """The generators: each wraps one engine and streams rollouts to the trainer (``[generator]``)."""

    count: int = 1
    """Generators ``specroll launch`` starts. Default 1."""
    engine: EngineConfig = EngineConfig()
    """The engine of each generator (``[generator.engine]``). Its ``model`` follows ``model.name``: leave
    it unset (or equal to ``model.name``). Its ``num_threads`` unset: under ``specroll launch`` on a
    CPU, the generators share the half of the cores the trainer does not get (the launcher's CPU budget)."""
    sampling: SamplingParams = SamplingParams()
    """How rollouts are sampled (``[generator.sampling]``): temperature, top_p, top_k, max_tokens.
    ``seed`` must stay unset: each request's seed derives from the run seed."""
    kv_policy: Literal["keep", "recompute"] = "keep"
    """What running requests do on a weight update: ``keep`` (default) reuses KV computed under the
    older weights (recorded per token); ``recompute`` prefills it again under the new ones."""
    stream_every_steps: int = 4
    """Engine steps between rollout chunks sent to the trainer (finished samples are sent at once).
    Default 4."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats to the trainer. Default 1.0."""
    speculative: Literal["off", "suffix", "eagle", "auto"] = "off"
    """Speculative decoding: ``off`` (default), ``suffix`` (model-free n-gram drafts), ``eagle``
    (the learned drafter; needs ``[drafter]``) or ``auto`` (``eagle`` when a drafter is configured,
    else ``suffix``)."""
    stats_s: float = 5.0
    """Seconds between ``Stats`` messages (engine throughput, draft acceptance) to the trainer.
    Default 5.0."""
    linger_s: float = 1.0
    """On a graceful stop: seconds to flush unsent chunks, then seconds to deliver ``Dead``. Default 1.0."""
    max_outbox: int = 256
    """Messages queued for the trainer before the step loop waits for it (backpressure, bounded
    memory). Default 256."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.count >= 1, "count", self.count, "a positive integer")
        _require(self.sampling.seed is None, "sampling.seed", self.sampling.seed,
                 "unset (per-request seeds derive from the run seed; one seed gives a group identical samples)")
        _require(self.stream_every_steps >= 1, "stream_every_steps", self.stream_every_steps, "a positive integer")
        _require(self.heartbeat_s > 0 and math.isfinite(self.heartbeat_s), "heartbeat_s", self.heartbeat_s,
                 "a positive number of seconds")
        for name in ("stats_s", "linger_s"):
            _require(getattr(self, name) > 0 and math.isfinite(getattr(self, name)), name, getattr(self, name),
                     "a positive number of seconds")
        _require(self.max_outbox >= 1, "max_outbox", self.max_outbox, "a positive integer")
