"""The launcher's CPU budget: torch threads for each role from the cores this process may run on, for
the thread counts the config leaves unset.

Measured on a 2-core CPU with SmolLM2-135M (docs/running-rl.md, "CPU budget"): the trainer's step is the
bottleneck of the off-step pipeline (a step's forward and backward take longer than generating the
next step's rollouts), a decode step costs about the same at batch 8 and at batch 32, and threads
beyond the cores (four processes on two cores before) slow every role down — torch's intra-op
threads wait for each other at every operator. Hence, on C cores:

* the trainer gets ``ceil(C / 2)`` threads: it is the bottleneck; a trainer of N ranks
  (``trainer.world_size``) divides them, ``max(1, ceil(C / 2) // N)`` per rank (its borrowed
  threads too), as N processes of T threads on the same cores would wait for each other;
* the generators share the other ``floor(C / 2)`` (at least one each), which the trainer borrows
  (``trainer.borrow_threads``) for a micro-batch whenever no rollout is queued or generating: the
  timeline shows the generator idle for about half of each step once the next batch is done;
* the drafter trainer keeps its own ``drafter.num_threads`` (default 1): it trains only on idle
  capacity (``drafter.train_below``, ``pause_during_train_step``), so it borrows cores others left.

Only a GPU-less run is budgeted: on CUDA the threads matter little and are left to torch.
"""

from __future__ import annotations

import os

import msgspec

from specroll.actors.config import RunConfig


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def with_cpu_budget(config: RunConfig, cores: int) -> RunConfig:
    """``config`` with ``trainer.train_threads`` and ``generator.engine.num_threads`` filled in for
    ``cores`` cores where they are unset (set values are kept). See the module docstring.

    Raises:
        ValueError: ``cores`` < 1.
    """
    if cores < 1:
        raise ValueError(f"cores={cores}, expected a positive integer")
    engine = config.generator.engine
    if engine.device != "cpu":
        return config
    ranks = config.trainer.world_size
    trainer_threads = config.trainer.train_threads or max(1, -(-cores // 2) // ranks)  # per rank
    generator_threads = engine.num_threads or max(1, (cores // 2) // config.generator.count)
    borrow = config.trainer.borrow_threads
    if borrow is None:  # per rank too
        borrow = min(generator_threads * config.generator.count, max(cores - trainer_threads * ranks, 0)) // ranks
    return msgspec.structs.replace(
        config,
        trainer=msgspec.structs.replace(config.trainer, train_threads=trainer_threads, borrow_threads=borrow),
        generator=msgspec.structs.replace(config.generator, engine=msgspec.structs.replace(
            engine, num_threads=generator_threads)),
    )


def budget_line(config: RunConfig, cores: int) -> str:
    """What each role gets, in one line for the launcher's output."""
    trainer = config.trainer.train_threads or "torch's default"
    ranks = config.trainer.world_size
    if ranks > 1:
        trainer = f"{ranks} ranks x {trainer}"
    generator = config.generator.engine.num_threads or "torch's default"
    drafter = f", the drafter trainer {config.drafter.num_threads} on idle capacity" \
        if config.runs_drafter_trainer() else ""
    borrow = config.trainer.borrow_threads
    borrowed = f" (+{borrow} while the generators are idle)" if borrow else ""
    return (f"CPU budget on {cores} core(s): trainer {trainer} thread(s){borrowed}, {config.generator.count} "
            f"generator(s) x {generator}{drafter}")
