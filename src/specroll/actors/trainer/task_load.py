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

VERIFIERS = "verifiers:"
"""``task.environment``'s prefix for a ``verifiers`` taskset (``specroll.envs.verifiers_env``)."""


def load_task(config: RunConfig) -> TaskSplit:
    """The run's training prompts and held-out evaluation prompts (``[task]`` and ``[eval]``): the
    built-in task's own split; a prompt file's last ``eval.count`` prompts held out (none while
    ``eval.every`` is 0); or, with ``eval.prompts``, that file's first ``eval.count``; a ``verifiers``
    taskset's tasks, split as a prompt file's (``task.environment = "verifiers:..."``).

    Raises:
        PromptFileError: a prompt file cannot be read or is malformed.
        ValueError: the split leaves nothing to train on, or an evaluation prompt has no answer; a
            verifiers taskset with a prompt file, or that does not load (``EnvironmentLoadError``).
    """
    task, ev = config.task, config.eval
    if task.environment is not None and task.environment.startswith(VERIFIERS):
        return _verifiers_task(config)
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


def _verifiers_task(config: RunConfig) -> TaskSplit:
    """A ``verifiers`` taskset's tasks as the run's prompts (``specroll.envs.verifiers_env``): its last
    ``eval.count`` held out (none while ``eval.every`` is 0). Its environment scores every episode,
    so a prompt needs no answer.

    Raises:
        ValueError: ``task.prompts`` or ``eval.prompts`` is set (the taskset is the prompts), the
            taskset does not load (``EnvironmentLoadError``), or the split leaves nothing to train on.
    """
    from specroll.envs.verifiers_env import verifiers_prompts

    task, ev = config.task, config.eval
    for key, value in (("task.prompts", task.prompts), ("eval.prompts", ev.prompts)):
        if value is not None:
            raise ValueError(f"{key} = {value!r} with task.environment = {task.environment!r}: a verifiers taskset "
                             "brings its own prompts (expected it unset)")
    assert task.environment is not None
    prompts = verifiers_prompts(task.environment, task.max_prompts)
    return TaskSplit(prompts, []) if not ev.every else hold_out(prompts, ev.count)


def load_environment(config: RunConfig) -> Environment:
    """The environment ``task.environment`` names: the built-in ``calculator``, a ``verifiers:``
    taskset, or ``package.module:function``.

    Raises:
        EnvironmentLoadError: it cannot be loaded (the message names it).
    """
    from specroll.envs.base import EnvironmentLoadError, import_environment

    try:
        import openai  # noqa: F401  (every environment's client)
    except ImportError:
        raise EnvironmentLoadError(f"task.environment = {config.task.environment!r} needs the openai package: "
                                   "pip install 'specroll[server,agentic]'") from None
    from specroll.envs.calculator import CalculatorEnv, Latency

    task = config.task
    spec = task.environment or ""
    if spec == "calculator":
        return CalculatorEnv(Latency(task.tool_latency_median_s, task.tool_latency_p99_s), task.max_turns)
    if spec.startswith(VERIFIERS):
        from specroll.envs.verifiers_env import VerifiersEnv

        return VerifiersEnv(spec, task.max_turns, task.max_prompts)
    return import_environment(spec)
