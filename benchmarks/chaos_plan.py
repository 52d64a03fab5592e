"""The chaos benchmark's plan: the size of the launched run, its kills and network faults and when
each is due (:meth:`Plan.schedule`), the full and CI (``--quick``) presets, and the run's config file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KILL_KINDS = ("mid-chunk", "mid-weights-fetch", "mid-drafter-swap", "after-rejoin")
NETWORK_KINDS = ("stall", "reset", "half-open", "slow")
"""Faults of one generator's link to the trainer (``stall``, ``reset``, ``half-open``) or of every
peer's (``slow``), made by the relay in front of the trainer (``chaos_network.py``)."""


@dataclass(frozen=True)
class Plan:
    """The run and its kills."""

    groups: int
    generators: int
    kills: int
    batch_groups: int = 4
    group_size: int = 4
    max_tokens: int = 48
    max_staleness: int = 1
    fork_roles: bool = True
    """``launch.fork_roles``: roles forked from the launcher, or fresh interpreters."""
    event_wait_s: float = 20.0
    """How long a kill waits for its moment (a log line) before it kills at a random moment instead."""
    faults: int = 0
    """Network faults (``--network``), cycling through ``NETWORK_KINDS``; with any, the trainer is
    also paused once (SIGSTOP, then SIGCONT after ``pause_s``)."""
    stall_s: float = 12.0
    """How long a stalled link holds: past the trainer's heartbeat timeout and the generator's ZMTP
    timeout (10 s), so the generator is declared gone and connects again while its old connection
    still holds what it sent."""
    slow_s: float = 8.0
    """How long every link is slowed by ``slow``."""
    slow_delay_ms: float = 20.0
    """Delay of each chunk while slowed, in milliseconds."""
    slow_bytes_per_s: float = 1_000_000.0
    """Each direction of each connection while slowed, in bytes a second."""
    pause_s: float = 12.0
    """How long the trainer stays stopped: past its peers' ZMTP timeout, so they connect again
    while it cannot read (the pause that made libzmq abort it)."""
    takeover_s: float = 2.0
    """After the pause, how long the relay still holds the trainer's old connections (the trainer
    takes its peers' routes over onto their new connections meanwhile)."""
    heartbeat_timeout_s: float = 5.0
    """``network.heartbeat_timeout_s`` of a run with network faults (below ``stall_s``)."""

    @property
    def steps(self) -> int:
        return max(2, self.groups // self.batch_groups)

    def schedule(self) -> list[Slot]:
        """The kills and faults in order: generator kills cycling through ``KILL_KINDS``, each
        followed by a network fault while there are faults left (the rest at the end), cycling
        through ``NETWORK_KINDS``; the trainer's pause half way, the drafter trainer's kill a third of
        the way and the trainer's two thirds of the way; due at steps spread evenly from step 1 to
        about 70% of the run (``Chaos.run``)."""
        kills = [KILL_KINDS[i % len(KILL_KINDS)] for i in range(self.kills)]
        faults = [NETWORK_KINDS[i % len(NETWORK_KINDS)] for i in range(self.faults)]
        kinds = [k for pair in zip(kills, faults, strict=False) for k in pair]
        kinds += kills[len(faults):] + faults[len(kills):]
        if self.faults:
            kinds.insert(len(kinds) // 2, "trainer-pause")
        kinds.insert(len(kinds) // 3, "drafter")
        kinds.insert(2 * len(kinds) // 3, "trainer")
        last = max(1, int(0.7 * self.steps))
        due = [1 + (i * (last - 1)) // max(1, len(kinds) - 1) for i in range(len(kinds))]
        give_up = [max(d + 1, n) for d, n in zip(due, [*due[1:], due[-1] + 1], strict=True)]
        return [Slot(kind, d, g) for kind, d, g in zip(kinds, due, give_up, strict=True)]


@dataclass(frozen=True)
class Slot:
    """One kill of the schedule: what it kills, the step it waits for, the step its wait ends at."""

    kind: str
    step: int
    give_up_step: int


FULL = Plan(groups=320, generators=3, kills=20)
QUICK = Plan(groups=40, generators=2, kills=3, event_wait_s=10.0)
FULL_FAULTS = 12
QUICK_FAULTS = 4


def run_config(plan: Plan, model: Path, run_dir: Path, seed: int, relay: tuple[int, str] | None = None) -> str:
    """The launched run: tiny model, checkpoints every step, a drafter trained online, quick restarts;
    with ``relay`` (the trainer's port, the relay's endpoint) the peers connect through the relay,
    and a heartbeat timeout below the stalls."""
    network = "" if relay is None else f"""
[network]
trainer_port = {relay[0]}
peer_endpoint = {json.dumps(relay[1])}
heartbeat_timeout_s = {plan.heartbeat_timeout_s}
"""
    return f"""
run_dir = {json.dumps(str(run_dir))}
seed = {seed}
steps = {plan.steps}

[model]
name = {json.dumps(str(model))}

[task]
builtin_count = {max(64, plan.groups * 2)}

[trainer]
batch_groups = {plan.batch_groups}
group_size = {plan.group_size}
max_groups_in_flight = {2 * plan.batch_groups}
max_staleness = {plan.max_staleness}
checkpoint_every = 1
train_threads = 1
dropped_prompts = "retry"

[generator]
count = {plan.generators}
heartbeat_s = 0.5
speculative = "eagle"
stream_every_steps = 2

[generator.engine]
dtype = "float32"
kv_cache_memory_gb = 0.02
max_num_seqs = 16
num_threads = 1

[generator.sampling]
max_tokens = {plan.max_tokens}

[drafter]
enabled = true
min_rollouts = 2
publish_every_steps = 2
window_tokens = 16
draft_vocab_size = 64
duty_cycle = 0.5

[eval]
every = 0

[launch]
max_restarts = {plan.kills + 10}
restart_backoff_s = 0.5
restart_backoff_max_s = 2.0
fork_roles = {str(plan.fork_roles).lower()}
""" + network
