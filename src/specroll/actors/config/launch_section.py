"""``[launch]``: how ``specroll launch`` supervises the processes it starts (``actors/launch/supervision.py``)."""

from __future__ import annotations

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.section import require_seconds as _require_seconds

MAX_RESTARTS = 1000
"""The most restarts of one role ``max_restarts`` may allow in a window."""
MAX_BACKOFF_S = 3600.0
"""The longest back-off before a restart, in seconds."""


class LaunchConfig(_Section):
    """How ``specroll launch`` supervises the processes it starts (``[launch]``).

    A role that dies is started again after a back-off of ``restart_backoff_s`` doubling with each
    restart of that role in the window (at most ``restart_backoff_max_s``): a generator (its groups
    resume on the others meanwhile, and on it once it rejoins), the drafter trainer (warm-started
    from ``RUN_DIR/drafter``) and the trainer (from its last checkpoint, on the same port, while the
    generators keep running). A role that died more than ``max_restarts`` times within
    ``restart_window_s`` ends the run (the drafter trainer's end only stops drafter training); a role
    refused its configuration (exit 2) is never restarted.
    """

    max_restarts: int = 5
    """Restarts of one role allowed within ``restart_window_s``, 0 to 1000; 0 ends the run at the first
    death (the drafter trainer's excepted). Default 5."""
    restart_window_s: float = 600.0
    """Seconds over which restarts are counted against ``max_restarts``, at most a week. Default 600."""
    restart_backoff_s: float = 1.0
    """Seconds before the first restart of a role in the window; doubled for each further one. At most
    3600. Default 1."""
    restart_backoff_max_s: float = 30.0
    """Longest back-off, in seconds, at most 3600. Default 30."""
    fork_roles: bool = True
    """Start each role (and each restart) by forking the launcher, which has imported torch and the
    role modules once, instead of a fresh ``python -m`` interpreter: a restart skips the ~3
    CPU-seconds of imports (``actors/launch/role_fork.py``). Linux only; elsewhere, or false, every
    role is a fresh interpreter. Default true."""
    gpu_per_role: bool = True
    """On a multi-GPU host, give every CUDA role GPUs of its own: the trainer's ranks GPUs
    ``0 .. trainer.world_size - 1`` (with ``trainer.device = "cuda"``), then each generator whose
    ``generator.engine.device`` is ``cuda`` the next one, then a drafter trainer on ``cuda``
    (``CUDA_VISIBLE_DEVICES``; ``actors/launch/gpu_plan.py``). False: every role sees every GPU and
    uses its ``cuda:0``. Not used under Ray, which assigns GPUs by ``num_gpus``. Default true."""

    def __post_init__(self) -> None:
        _require_count("max_restarts", self.max_restarts, 0, MAX_RESTARTS)
        _require_seconds("restart_window_s", self.restart_window_s)
        for name in ("restart_backoff_s", "restart_backoff_max_s"):
            _require_seconds(name, getattr(self, name), MAX_BACKOFF_S, zero=True)
        _require(self.restart_backoff_max_s >= self.restart_backoff_s, "restart_backoff_max_s",
                 self.restart_backoff_max_s, f"at least restart_backoff_s = {self.restart_backoff_s}")

    def backoff_s(self, restarts_in_window: int) -> float:
        """Seconds to wait before restart number ``restarts_in_window`` (1, 2, …) of a role."""
        return min(self.restart_backoff_max_s, self.restart_backoff_s * 2.0 ** max(0, restarts_in_window - 1))
