"""Supervision (``[launch]``, :class:`~specroll.actors.config.launch_section.LaunchConfig`): what the
launcher does when a role's process exits during the run — restart it after a back-off, leave it
down, or end the run (the rules: step 4 of the lifecycle in ``launch.py``).

* A death is counted against ``launch.max_restarts`` within ``launch.restart_window_s``, except a
  generator's or the drafter trainer's exit 0 or 3 while the trainer is away (down, or restarted
  within ``2 × network.heartbeat_timeout_s``): that restart is not its own failure.
* The back-off doubles with each counted death in the window (``LaunchConfig.backoff_s``).
* The trainer's ranks are one unit: one rank's death stops the others and restarts all together,
  one death of ``trainer``; a rank other than 0 exiting 0 (it read rank 0's ``Stop``) is no death.
* A refused configuration (exit 2), ``max_restarts = 0`` or too many deaths end the run — except for
  the drafter trainer, which is not essential: a warning, and the run goes on without it.
* Every restart is a line and a count in ``RUN_DIR/restarts.json`` (``shared/restarts.py``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.rank_roles import TRAINER_ROLE, is_trainer_rank
from specroll.actors.launch.role_process import death_error, describe_exit, killpg, observe_exit, terminate
from specroll.actors.launch.role_starts import Role, RoleStarts
from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_PEER_LOST, EXIT_REFUSED
from specroll.actors.shared.restarts import write_restarts

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig

DRAFTER_ROLE = "drafter"
"""The drafter trainer's role name: not essential, so its death is reported and the run goes on."""


@dataclass
class Supervisor:
    """Handles the deaths of the run's roles and starts their restarts when due (module docstring).

    Args:
        config: the validated run config (``[launch]``, ``trainer.world_size``, ``network``).
        starts: the run's roles and how to start them again.
        say: where status lines go.
        grace_s: how long the other trainer ranks get to exit after SIGTERM before SIGKILL.
        poll_s: how often a stopping rank is looked at.
        interrupted: whether the launcher was signalled (the grace period is then cut short).
    """

    config: RunConfig
    starts: RoleStarts
    say: Callable[[str], None]
    grace_s: float
    poll_s: float
    interrupted: Callable[[], bool]
    restarts: dict[str, int] = field(default_factory=dict, init=False)
    """Restarts so far by role (also in ``RUN_DIR/restarts.json`` and the metrics lines)."""

    def poll(self) -> None:
        """Handle every role's process that exited since the last poll, then start the restarts now due.

        Raises:
            ~specroll.actors.launch.errors.LaunchError: a death ends the run (:meth:`on_death`), or a
                restart cannot be started (its log cannot be written: a full disk).
        """
        roles = self.starts.roles
        for role in roles.values():
            code = observe_exit(role.proc) if role.proc is not None else None
            if code is not None:
                self.on_death(role, code)
        self.starts.reap_exited()
        now = time.monotonic()
        for role in roles.values():
            if role.restart_at is not None and now >= role.restart_at:
                role.restart_at = None
                try:
                    self.starts.respawn(role, self.config.trainer.world_size)
                except OSError as e:  # its log cannot be opened (a full disk): the run cannot go on
                    raise LaunchError(f"cannot start {role.name} again ({e.strerror or e}: {e.filename}); "
                                      "stopping the run") from None

    def on_death(self, role: Role, code: int) -> None:
        """A role's process exited during the run: schedule its restart, or end the run (raise)."""
        proc = role.proc
        assert proc is not None
        role.proc = None
        killpg(proc, signal.SIGKILL)  # what it left in its group serves nothing; the group empties, it is reaped
        self.starts.write_pids()
        ranked = self.config.trainer.world_size > 1 and is_trainer_rank(role.name)
        if ranked and role.name != TRAINER_ROLE and code == EXIT_OK:
            return  # it read rank 0's Stop: rank 0's own exit says how the trainer ended
        drafter = role.name == DRAFTER_ROLE
        limits = self.config.launch
        if code == EXIT_REFUSED or (limits.max_restarts == 0 and not drafter):
            if drafter:
                self.say(f"warning: the drafter trainer (pid {proc.pid}) {describe_exit(code)}; generation "
                         f"and training go on with the last drafter version (see {proc.log_path})")
                return
            raise death_error(proc, code)
        if ranked:  # the ranks are one unit: the others are stopped, one death counted, all restarted
            self._stop_trainer_ranks()
            role = self.starts.roles[TRAINER_ROLE]
        now = time.monotonic()
        counted = not self._victim_of_trainer(role, code, now)
        if counted:
            role.deaths = [t for t in role.deaths if now - t <= limits.restart_window_s] + [now]
        if len(role.deaths) > limits.max_restarts:
            n = len(role.deaths)
            deaths = (f"{n} death{'s' if n != 1 else ''} within {limits.restart_window_s:g} s, more than "
                      f"launch.max_restarts = {limits.max_restarts}")
            if drafter:
                again = " again" if role.restarts else ""
                self.say(f"warning: the drafter trainer (pid {proc.pid}) {describe_exit(code)} ({deaths}): not "
                         f"restarted{again}; generation and training go on with the last drafter version "
                         f"(see {proc.log_path})")
                return
            raise death_error(proc, code, f"({deaths})")
        delay = limits.backoff_s(len(role.deaths)) if counted else 0.0
        role.restart_at = now + delay
        role.restarts += 1
        self.restarts[role.name] = role.restarts
        try:
            write_restarts(self.starts.run_dir, self.restarts)
        except OSError as e:  # a full disk: the restart goes on; the metrics lines miss this count until later
            self.say(f"warning: cannot write the restart counts ({e.strerror or e}): {e.filename or ''}")
        why = "" if counted else " while the trainer was away (not counted)"
        what = "and rejoins"
        if role.name == TRAINER_ROLE:
            world = self.config.trainer.world_size
            what = "from its last checkpoint" + (f", all {world} ranks" if world > 1 else "")
        self.say(f"{proc.name} (pid {proc.pid}) {describe_exit(code)}{why}; restart {role.restarts} of "
                 f"{role.name} in {delay:g} s ({what}; see {proc.log_path})")

    def _stop_trainer_ranks(self) -> None:
        """One rank died: stop the others (SIGTERM, ``grace_s`` to exit — rank 0 says ``Dead`` to the
        generators — then SIGKILL), so the whole unit restarts from the checkpoint together."""
        ranks = [r for r in self.starts.roles.values() if is_trainer_rank(r.name) and r.proc is not None]
        for r in ranks:  # gone as well (rank 0 fails on its own when a peer dies): said, not counted
            if r.proc is not None and (code := observe_exit(r.proc)) is not None:
                self.say(f"{r.proc.name} (pid {r.proc.pid}) {describe_exit(code)} too")
        live = [r.proc for r in ranks if r.proc is not None and observe_exit(r.proc) is None]
        if live:
            self.say(f"stopping the other trainer ranks: {', '.join(p.name for p in live)}")
        for p in terminate(live, self.grace_s, self.poll_s, self.interrupted):
            killpg(p, signal.SIGKILL)
        for r in ranks:
            r.proc = None

    def _victim_of_trainer(self, role: Role, code: int, now: float) -> bool:
        """A generator or drafter trainer that exited because the trainer was away (down, or restarted
        recently): its restart is not its own failure and is not counted against ``max_restarts``."""
        if is_trainer_rank(role.name) or code not in (EXIT_OK, EXIT_PEER_LOST):
            return False
        trainer = self.starts.roles[TRAINER_ROLE]
        recent = 2 * self.config.network.heartbeat_timeout_s
        return trainer.proc is None or (trainer.restarts > 0 and now - trainer.started_at < recent)
