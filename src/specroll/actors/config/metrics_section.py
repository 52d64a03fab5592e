"""``[metrics]``: what a run exports while it runs — a Prometheus ``/metrics`` endpoint on every role
(``actors/telemetry/``) and the trainer's W&B and TensorBoard sinks (``actors/telemetry/sinks.py``)."""

from __future__ import annotations

from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import is_loopback_host
from specroll.actors.config.section import require as _require

DRAFTER_PORT_OFFSET = 1
"""``drafter-0`` (the drafter trainer ``specroll launch`` starts) binds ``port + 1``."""
GENERATOR_PORT_OFFSET = 2
"""``generator-<i>`` binds ``port + 2 + i`` (after the trainer's and the first drafter trainer's)."""


class MetricsConfig(_Section):
    """Live metrics (``[metrics]``): ``/metrics`` on every role, and the trainer's W&B / TensorBoard sinks.

    Every role writes where it listens to ``RUN_DIR/metrics/targets/<actor>.json`` (Prometheus's
    ``file_sd_configs`` format), so ``port = 0`` is discoverable and a restarted role is found again.
    """

    enabled: bool = False
    """Serve Prometheus ``GET /metrics`` on every role (trainer, each generator, the drafter trainer,
    ``specroll serve``). Default false."""
    host: str = "127.0.0.1"
    """Address every role's metrics endpoint binds. Default ``127.0.0.1``; a non-loopback address needs
    ``api_key`` (or ``network.allow_insecure``)."""
    port: int = 9400
    """Base TCP port: the trainer (and ``specroll serve``) binds it, ``drafter-0`` ``port + 1``,
    ``generator-<i>`` ``port + 2 + i``; a role started alone under another id binds ``port`` itself.
    0: each role picks a free port (see its target file). Default 9400."""
    api_key: str = ""
    """Bearer key a scrape must carry (``Authorization: Bearer KEY``, compared in constant time);
    empty (default): none. Never logged."""
    wandb: bool = False
    """Log the trainer's ``metrics.jsonl`` records to Weights & Biases (extra ``specroll[wandb]``).
    Default false."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` (default) writes the run under ``RUN_DIR/wandb`` with no network (``wandb sync`` it
    later); ``online`` streams it (``WANDB_API_KEY`` or ``wandb login``)."""
    wandb_project: str = "specroll"
    """W&B project. Default ``specroll``."""
    wandb_run_name: str = ""
    """W&B run name; empty (default): the run directory's name."""
    tensorboard: bool = False
    """Write the trainer's records as TensorBoard scalars under ``RUN_DIR/tensorboard`` (extra
    ``specroll[tensorboard]``). Default false."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(bool(self.host) and self.host == self.host.strip(), "host", self.host, "an address")
        _require(0 <= self.port <= 65535 - 64, "port", self.port, "a port in [0, 65471] (roles add offsets)")
        _require(self.api_key == self.api_key.strip(), "api_key", "<hidden>",
                 "a key without leading or trailing spaces")
        _require(bool(self.wandb_project.strip()), "wandb_project", self.wandb_project, "a project name")

    def is_loopback(self) -> bool:
        """Whether :attr:`host` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
        return is_loopback_host(self.host)

    def port_for(self, actor_id: str) -> int:
        """The port ``actor_id`` binds: ``trainer`` :attr:`port`, ``drafter-0`` ``port + 1``,
        ``generator-<i>`` ``port + 2 + i`` (``specroll launch``'s ids), any other id :attr:`port`; with
        :attr:`port` 0, 0 (a free port)."""
        if self.port == 0:
            return 0
        if actor_id == "drafter-0":
            return self.port + DRAFTER_PORT_OFFSET
        index = actor_id.removeprefix("generator-")
        if actor_id.startswith("generator-") and index.isdigit() and len(index) <= 4:
            return self.port + GENERATOR_PORT_OFFSET + int(index)
        return self.port
