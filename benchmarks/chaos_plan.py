"""The chaos benchmark's plan: the size of the launched run, its kills and when each is due
(:meth:`Plan.schedule`), the full and CI (``--quick``) presets, and the run's config file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KILL_KINDS = ("mid-chunk", "mid-weights-fetch", "mid-drafter-swap", "after-rejoin")


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

    @property
    def steps(self) -> int:
        return max(2, self.groups // self.batch_groups)

    def schedule(self) -> list[Slot]:
        """The kills in order: generator kills cycling through ``KILL_KINDS``, the drafter trainer's
        a third of the way and the trainer's two thirds of the way, due at steps spread evenly from
        step 1 to about 70% of the run (``Chaos.run``)."""
        kinds = [KILL_KINDS[i % len(KILL_KINDS)] for i in range(self.kills)]
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


def run_config(plan: Plan, model: Path, run_dir: Path, seed: int) -> str:
    """The launched run: tiny model, checkpoints every step, a drafter trained online, quick restarts."""
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
"""
