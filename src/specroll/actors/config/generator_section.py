"""``[generator]``: the generators — each generator's engine (``[generator.engine]``, the engine
layer's own :class:`~specroll.engine.config.EngineConfig`), how rollouts are sampled
(``[generator.sampling]``), streaming, heartbeats and speculative decoding."""

from __future__ import annotations

from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.section import require_seconds as _require_seconds
from specroll.engine.config import EngineConfig
from specroll.protocol.limits import MAX_SEQUENCE_TOKENS
from specroll.protocol.sampling import SamplingParams

MAX_GENERATORS = 1024
"""The most generators ``specroll launch`` starts (``count``)."""
MAX_LINGER_S = 60.0
"""The longest a stopping generator waits to flush and say ``Dead`` (``linger_s``), in seconds."""


class GeneratorConfig(_Section):
    """The generators: each wraps one engine and streams rollouts to the trainer (``[generator]``)."""

    count: int = 1
    """Generators ``specroll launch`` starts, 1 to 1024. Default 1."""
    engine: EngineConfig = EngineConfig()
    """The engine of each generator (``[generator.engine]``). Its ``model`` follows ``model.name``: leave
    it unset (or equal to ``model.name``). Its ``num_threads`` unset: under ``specroll launch`` on a
    CPU, the generators share the half of the cores the trainer does not get (the launcher's CPU budget)."""
    sampling: SamplingParams = SamplingParams()
    """How rollouts are sampled (``[generator.sampling]``): temperature, top_p, top_k, max_tokens.
    ``seed`` must stay unset: each request's seed derives from the run seed; ``max_tokens`` at most
    1,048,576 (the protocol's longest sequence)."""
    kv_policy: Literal["keep", "recompute"] = "keep"
    """What running requests do on a weight update: ``keep`` (default) reuses KV computed under the
    older weights (recorded per token); ``recompute`` prefills it again under the new ones."""
    stream_every_steps: int = 4
    """Engine steps between rollout chunks sent to the trainer (finished samples are sent at once), 1 to
    65536. Default 4."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats to the trainer, at most 3600. Default 1.0."""
    speculative: Literal["off", "suffix", "eagle", "auto"] = "off"
    """Speculative decoding: ``off`` (default), ``suffix`` (model-free n-gram drafts), ``eagle``
    (the learned drafter; needs ``[drafter]``) or ``auto`` (``eagle`` when a drafter is configured,
    else ``suffix``)."""
    stats_s: float = 5.0
    """Seconds between ``Stats`` messages (engine throughput, draft acceptance) to the trainer, at most
    3600. Default 5.0."""
    linger_s: float = 1.0
    """On a graceful stop: seconds to flush unsent chunks, then seconds to deliver ``Dead``; at most 60.
    Default 1.0."""
    max_outbox: int = 256
    """Messages queued for the trainer before the step loop waits for it (backpressure, bounded
    memory), 1 to 65536. Default 256."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require_count("count", self.count, 1, MAX_GENERATORS)
        _require_count("sampling.max_tokens", self.sampling.max_tokens, 1, MAX_SEQUENCE_TOKENS)
        _require(self.sampling.seed is None, "sampling.seed", self.sampling.seed,
                 "unset (per-request seeds derive from the run seed; one seed gives a group identical samples)")
        _require_count("stream_every_steps", self.stream_every_steps, 1, 1 << 16)
        _require_seconds("heartbeat_s", self.heartbeat_s, 3600)
        _require_seconds("stats_s", self.stats_s, 3600)
        _require_seconds("linger_s", self.linger_s, MAX_LINGER_S)
        _require_count("max_outbox", self.max_outbox, 1, 1 << 16)
