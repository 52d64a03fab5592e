"""Environments from the ``verifiers`` package: ``task.environment = "verifiers:<taskset id>"``.

A ``verifiers`` (v1 API, ``import verifiers.v1 as vf``; tested with 0.4.0) taskset is the data half
of an environment — its tasks carry ids, prompts and whatever their rewards read — and its ``Env``
turns one task into one episode (one agent rollout for a plain taskset). Here:

- **Prompts.** The run's prompts are the taskset's tasks (:func:`verifiers_prompts`): one
  :class:`~specroll.rl.tasks.Prompt` per task, its ``prompt_id`` the task's ``id`` (its position in
  the taskset when it has none), so the trainer's prompt order and held-out split work as for a
  prompt file.
- **Episodes.** :class:`VerifiersEnv` builds the taskset's ``Env`` once per process (lazily, in a
  worker thread: importing ``verifiers.v1`` takes seconds) and holds its serving resources (the
  interception server, taskset-scoped tool servers) open in a task of its own; concurrent episodes
  share them (``Env.run_slot`` is built for that). Each episode runs one slot of the task its prompt
  names with a ``ModelContext`` pointed at the client's ``base_url`` (the key put into the
  environment variable :data:`API_KEY_VAR`, which ``verifiers`` reads by name: it accepts no client
  object) and the episode's sampling (seed included). ``verifiers`` sends its trace id as
  ``X-Session-ID``; ``on_trace`` sees the trace before any request, and ``prompt.record_session``
  makes the server record that session's turns as this episode's.
- **The harness.** Every seat runs specroll's in-process chat and tool loop
  (:mod:`specroll.envs.verifiers_harness`) in the ``subprocess`` runtime (a scratch directory: no
  process is started for the loop; ``verifiers``' own ``null`` harness would start a ``uv`` script
  per rollout). Tools are MCP servers (``vf.Toolset``): a taskset-scoped toolset
  (``Taskset.toolsets``) starts one process for the whole run, a task-scoped one
  (``Task.toolsets``) one per rollout. Tasksets whose harness must execute code (``bash``, coding
  agents) need a sandbox and are not run here.
- **The outcome.** The reward of the episode's trainable traces (their mean when several) and the
  figures ``turns``, ``tool_calls`` and each numeric ``@vf.metric`` (``metric_<name>``); an
  episode that is not ``ok`` (an error in a hook, the harness or the model call) raises, so
  specroll's retries and group dropping apply.

``verifiers`` 0.4 resolves a plugin id only as an undotted, importable module; a dotted module path
(``my_pkg.my_tasks``) is imported here and registered under ``verifiers.v1.tasksets`` so it
resolves too, and so is the harness (under :data:`HARNESS_ID`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from specroll.envs.base import EnvironmentLoadError, EpisodeOutcome, EpisodePrompt
from specroll.rl.tasks import Prompt

if TYPE_CHECKING:
    import openai

__all__ = ["API_KEY_VAR", "HARNESS_ID", "PREFIX", "VerifiersEnv", "VerifiersEpisodeError", "taskset_id",
           "verifiers_prompts"]

log = logging.getLogger("specroll.envs")

PREFIX = "verifiers:"
HARNESS_ID = "specroll_inprocess"
"""The id specroll's in-process harness is registered under (``verifiers.v1.harnesses.<id>``)."""
API_KEY_VAR = "SPECROLL_VERIFIERS_API_KEY"
"""The environment variable ``verifiers`` reads the server's key from (``api_key_var``)."""
INSTALL = "pip install 'specroll[verifiers]'"


class VerifiersEpisodeError(RuntimeError):
    """A ``verifiers`` episode ended not ``ok``; the message holds its errors."""


def taskset_id(spec: str) -> str:
    """The taskset id of ``task.environment = "verifiers:<taskset id>"``.

    Raises:
        EnvironmentLoadError: ``spec`` does not start with ``verifiers:`` or names no taskset.
    """
    name = spec[len(PREFIX):].strip() if spec.startswith(PREFIX) else ""
    if not name:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: expected 'verifiers:<taskset id>' (an importable "
                                   "module exporting a verifiers.v1 Taskset in __all__)")
    return name


def verifiers_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """The taskset's tasks as the run's prompts, in the taskset's order: ``prompt_id`` the task's
    ``id`` (else its position), ``question`` its prompt text (else its name or id), ``answer`` its
    data's ``answer`` field when it has one (``str``), else None.

    Args:
        spec: ``verifiers:<taskset id>``.
        limit: at most this many tasks (needed for an infinite taskset); None: all.

    Raises:
        EnvironmentLoadError: verifiers is not installed, the taskset does not load, is infinite
            without ``limit``, holds no task or repeats an id.
    """
    return [_prompt(task) for task in _tasks(_load_taskset(spec), spec, limit).values()]


class VerifiersEnv:
    """A ``verifiers`` taskset as a specroll environment (module docstring).

    Args:
        spec: ``verifiers:<taskset id>``.
        max_turns: the model turns a rollout may take (``AgentConfig.max_turns``: verifiers ends
            the rollout there; specroll fails an episode past ``task.max_turns``).
        limit: the tasks the run's prompts were drawn from (``task.max_prompts``).

    Raises:
        EnvironmentLoadError: verifiers is not installed, or ``spec`` names no taskset.
    """

    def __init__(self, spec: str, max_turns: int, limit: int | None = None) -> None:
        self.spec, self.taskset, self.max_turns, self.limit = spec, taskset_id(spec), max_turns, limit
        _check_installed()  # importing verifiers.v1 takes seconds: the first episode does it, off the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[_Serving] | None = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task[None] | None = None

    async def __call__(self, client: openai.AsyncOpenAI, prompt: EpisodePrompt) -> EpisodeOutcome:
        """Run one episode of the task ``prompt`` names (module docstring).

        Raises:
            EnvironmentLoadError: the environment does not build, or no task has the prompt's id.
            VerifiersEpisodeError: the episode ended not ``ok``.
        """
        serving = await self._serving()
        vf = _verifiers()  # imported by now
        task = serving.tasks.get(prompt.prompt.prompt_id)
        if task is None:
            raise EnvironmentLoadError(f"{self.spec}: no task has id {prompt.prompt.prompt_id!r}")
        os.environ[API_KEY_VAR] = client.api_key or "EMPTY"
        ctx = vf.ModelContext(
            model=prompt.model, sampling=vf.SamplingConfig(**prompt.sampling),
            client=vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=API_KEY_VAR))

        def minted(trace: Any) -> None:  # at the trace's mint, before its first request
            if prompt.record_session is not None:
                prompt.record_session(trace.id)

        (slot,) = serving.env.slots(task, 1)
        episode = await serving.env.run_slot(slot, ctx, on_trace=minted)
        if not episode.ok:
            errors = [f"{e.type}: {e.message[:300]}" for e in [*episode.errors, *(x for t in episode.traces
                                                                                 for x in t.errors)]]
            raise VerifiersEpisodeError(f"{self.spec} task {prompt.prompt.prompt_id!r}: "
                                        f"{'; '.join(errors) or 'not ok, no error recorded'}")
        return outcome(episode)

    async def aclose(self) -> None:
        """Close the serving resources (tool servers, interception) if they were opened in this
        event loop; the next episode opens them again. At a loop's end they close with it."""
        holder, stop = self._holder, self._stop
        self._ready = self._holder = self._stop = self._loop = None
        if holder is not None and stop is not None and holder.get_loop() is asyncio.get_running_loop():
            stop.set()
            await holder

    async def _serving(self) -> _Serving:
        loop = asyncio.get_running_loop()
        if self._ready is None or self._loop is not loop:  # no await between the check and the start
            self._loop, self._ready, self._stop = loop, loop.create_future(), asyncio.Event()
            self._holder = loop.create_task(self._hold(self._ready, self._stop), name=f"verifiers {self.taskset}")
        return await asyncio.shield(self._ready)

    async def _hold(self, ready: asyncio.Future[_Serving], stop: asyncio.Event) -> None:
        """Build the env and hold its serving resources open until ``stop`` (a task of its own:
        an episode cancelled mid-way must not close what the others use)."""
        try:
            env, tasks = await asyncio.to_thread(self._build)
            async with env.serving():
                ready.set_result(_Serving(env, tasks))
                await stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, EnvironmentLoadError) else EnvironmentLoadError(
                    f"{self.spec}: the verifiers environment does not start ({type(e).__name__}: {e})"))
            else:
                log.warning("%s: closing the verifiers environment failed: %s: %s", self.spec, type(e).__name__, e)
        finally:
            if not ready.done():
                ready.cancel()

    def _build(self) -> tuple[Any, dict[str, Any]]:
        vf = _verifiers()
        from verifiers.v1.utils.loaders import load_environment

        env = load_environment(_env_config(vf, _registered_taskset(self.taskset, self.spec), self.max_turns))
        return env, _tasks(env.taskset, self.spec, self.limit)


@dataclass(frozen=True)
class _Serving:
    env: Any
    """The ``vf.Env``, inside ``serving()``."""
    tasks: dict[str, Any]
    """Its tasks by prompt id."""


def outcome(episode: Any) -> EpisodeOutcome:
    """A finished ``vf.Episode`` as an :class:`EpisodeOutcome`: the mean reward of its trainable
    traces (all of them when none is marked), ``turns`` (model turns), ``tool_calls`` (tool
    results) and ``metric_<name>`` for each finite ``@vf.metric`` (means over the traces)."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    reward = sum(t.reward for t in traces) / max(len(traces), 1)
    metrics: dict[str, float] = {"turns": float(episode.num_turns),
                                 "tool_calls": float(sum(len(t.tool_messages) for t in episode.traces))}
    for name in sorted({k for t in traces for k in t.metrics}):
        values = [v for t in traces if isinstance(v := t.metrics.get(name), int | float) and math.isfinite(v)]
        if values:
            metrics[f"metric_{name}".replace(" ", "_")] = sum(values) / len(values)
    return EpisodeOutcome(float(reward), metrics)


def _check_installed() -> None:
    """Raises:
        EnvironmentLoadError: verifiers (its v1 API) is not installed.
    """
    try:
        found = importlib.util.find_spec("verifiers.v1") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise EnvironmentLoadError(f"task.environment = 'verifiers:...' needs the verifiers package (0.4 or later): "
                                   f"{INSTALL}")


def _verifiers() -> ModuleType:
    """``verifiers.v1``, with specroll's harness registered.

    Raises:
        EnvironmentLoadError: verifiers is not installed.
    """
    try:
        vf = importlib.import_module("verifiers.v1")
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "verifiers":
            raise
        raise EnvironmentLoadError(f"task.environment = 'verifiers:...' needs the verifiers package: {INSTALL}") \
            from None
    from specroll.envs import verifiers_harness

    sys.modules.setdefault(f"verifiers.v1.harnesses.{HARNESS_ID}", verifiers_harness)
    return vf


def _registered_taskset(name: str, spec: str) -> str:
    """The id verifiers resolves ``name`` by: an undotted id as it is; a dotted module path imported
    here and registered as ``verifiers.v1.tasksets.<path with '__' for '.'>``.

    Raises:
        EnvironmentLoadError: the module does not import.
    """
    if "." not in name:
        return name
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: module {name!r} does not import ({e})") from e
    alias = name.replace(".", "__").replace("-", "_").lower()
    sys.modules.setdefault(f"verifiers.v1.tasksets.{alias}", module)
    return alias


def _env_config(vf: ModuleType, taskset: str, max_turns: int) -> Any:
    """The taskset's ``EnvConfig`` with every seat on specroll's harness, the ``subprocess``
    runtime (the default is a remote sandbox) and ``max_turns``; other seat settings kept."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import env_config_type

    cls = env_config_type(taskset)
    seats = agent_config_fields(cls.model_validate({"taskset": {"id": taskset}}))
    pinned = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}, "max_turns": max_turns}
    return cls.model_validate({"taskset": {"id": taskset},
                               **{name: {**seat.model_dump(exclude_unset=True), **pinned}
                                  for name, seat in seats.items()}})


def _load_taskset(spec: str) -> Any:
    """The taskset ``spec`` names, loaded with its default config.

    Raises:
        EnvironmentLoadError: verifiers is not installed or the taskset does not load.
    """
    vf = _verifiers()
    from verifiers.v1.utils.loaders import load_taskset

    try:
        config = _env_config(vf, _registered_taskset(taskset_id(spec), spec), 1)
        return load_taskset(config.taskset)
    except EnvironmentLoadError:
        raise
    except Exception as e:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: the taskset does not load "
                                   f"({type(e).__name__}: {e})") from e


def _tasks(taskset: Any, spec: str, limit: int | None) -> dict[str, Any]:
    """The taskset's tasks by prompt id, in its order (the first ``limit``).

    Raises:
        EnvironmentLoadError: infinite without ``limit``, no task, or a repeated id.
    """
    if limit is None and not taskset.bounded:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: the taskset is infinite; set task.max_prompts")
    tasks: dict[str, Any] = {}
    for task in taskset if limit is None else taskset.take(limit):
        key = _prompt_id(task.data)
        if key in tasks:
            raise EnvironmentLoadError(f"task.environment = {spec!r}: two tasks have id {key!r} (task ids must be "
                                       "unique)")
        tasks[key] = task
    if not tasks:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: the taskset holds no task")
    return tasks


def _prompt_id(data: Any) -> str:
    return str(data.id) if data.id is not None else str(data.idx)


def _prompt(task: Any) -> Prompt:
    data = task.data
    answer = getattr(data, "answer", None)
    return Prompt(_prompt_id(data), data.prompt_text or data.name or _prompt_id(data),
                  None if answer is None else str(answer))
