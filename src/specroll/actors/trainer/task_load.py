"""The run's prompts: training prompts and the held-out evaluation prompts (``[task]``, ``[eval]``).

Read by the trainer at its start and by ``specroll launch``'s preflight, which refuses a bad split
before anything starts; imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specroll.actors.config import RunConfig
from specroll.rl.tasks import TaskSplit, builtin_task, hold_out, load_prompts

if TYPE_CHECKING:
    from specroll.envs.base import Environment


def load_task(config: RunConfig) -> TaskSplit:
    """The run's training prompts and held-out evaluation prompts (``[task]`` and ``[eval]``): the
    built-in task's own split; a prompt file's last ``eval.count`` prompts held out (none while
    ``eval.every`` is 0); or, with ``eval.prompts``, that file's first ``eval.count``.

    Raises:
        PromptFileError: a prompt file cannot be read or is malformed.
        ValueError: the split leaves nothing to train on, or an evaluation prompt has no answer.
    """
    task, ev = config.task, config.eval
    if task.prompts is None:
        split = builtin_task(task.builtin_count, config.seed, digits=task.digits, operators=task.operators,
                             eval_count=ev.count)
    else:
        prompts = load_prompts(task.prompts, task.max_prompts)
        split = TaskSplit(prompts, []) if ev.prompts is not None or not ev.every else hold_out(prompts, ev.count)
    if ev.prompts is not None:
        split = TaskSplit(split.train, load_prompts(ev.prompts, ev.count), split.instruction)
    unanswered = [p.prompt_id for p in split.eval if p.answer is None]
    if unanswered:
        raise ValueError(f"evaluation prompts without an answer cannot be scored: {unanswered[:5]}"
                         f"{' ...' if len(unanswered) > 5 else ''} (give each an 'answer', or use other eval.prompts)")
    return split


def load_environment(config: RunConfig) -> Environment:
    """The environment ``task.environment`` names: the built-in ``calculator``, a ``verifiers:``
    taskset, or ``package.module:function``.

    Raises:
        EnvironmentLoadError: it cannot be loaded (the message names it).
    """
    from specroll.envs.base import import_environment
    from specroll.envs.calculator import CalculatorEnv, Latency

    task = config.task
    spec = task.environment or ""
    if spec == "calculator":
        return CalculatorEnv(Latency(task.tool_latency_median_s, task.tool_latency_p99_s), task.max_turns)
    return import_environment(spec)
