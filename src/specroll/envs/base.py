"""The interface of an environment: an async function of an OpenAI client and a prompt that runs
one episode through the client and returns its reward.

An environment talks to the policy only through the client it is given — ``openai.AsyncOpenAI``
(or its ``with_options`` copy) pointed at specroll's OpenAI-compatible server, with the episode's
``X-Session-ID`` set, so the server records every turn exactly as the generators ran it and stitches
each turn's prompt from the tokens before it (``actors/server/stitch.py``). It may call tools, wait on
sandboxes or judges, and take as many turns as it likes (at most ``task.max_turns`` are trained;
one more fails the episode); whatever it returns, the trainer trains the model tokens of the turns
the server recorded, never text the environment rewrote::

    async def my_env(client: openai.AsyncOpenAI, prompt: EpisodePrompt) -> float:
        reply = await client.chat.completions.create(
            model=prompt.model, messages=[{"role": "user", "content": prompt.question}], **prompt.sampling)
        return float(reply.choices[0].message.content.strip() == prompt.answer)

and in the run's config ``task.environment = "my_package.my_module:my_env"``. An exception, or more
than ``task.episode_timeout_s`` seconds, fails the episode: it runs again from the start while its
group's failures number at most ``trainer.max_group_retries``, then its whole group is dropped
(never a partial group).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specroll.rl.tasks import Prompt

if TYPE_CHECKING:
    import openai

__all__ = ["Environment", "EnvironmentLoadError", "EpisodeOutcome", "EpisodePrompt", "import_environment"]


@dataclass(frozen=True)
class EpisodePrompt:
    """What an environment is given for one episode.

    Attributes:
        prompt: the task's prompt (its id, question and reference answer).
        model: the served model's name (the ``model`` of every request).
        sampling: keyword arguments for ``client.chat.completions.create`` (and ``completions``):
            ``temperature``, ``top_p``, ``max_tokens``, ``seed`` and ``extra_body`` (``top_k``), the
            run's ``generator.sampling``; greedy for a greedy evaluation.
        seed: the episode's seed, for the environment's own randomness (a tool's latency, a user
            simulator): the same prompt position and attempt give the same seed across a restart.
        evaluation: the episode is a held-out evaluation (never trained on).
        record_session: ``record_session(session_id)`` makes the server record the turns of
            requests that carry ``X-Session-ID: session_id`` as this episode's too — for an
            environment whose client sets its own session id (``verifiers`` sets its trace id);
            call it before the first such request. None outside a trainer.
    """

    prompt: Prompt
    model: str
    sampling: Mapping[str, Any]
    seed: int
    evaluation: bool = False
    record_session: Callable[[str], None] | None = None

    @property
    def question(self) -> str:
        return self.prompt.question

    @property
    def answer(self) -> str | None:
        return self.prompt.answer


@dataclass(frozen=True)
class EpisodeOutcome:
    """An episode's end: its reward and figures the step's metrics line averages (e.g.
    ``tool_latency_s``; names without spaces)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


Environment = Callable[["openai.AsyncOpenAI", EpisodePrompt], Awaitable["float | EpisodeOutcome"]]
"""An environment: ``(client, prompt) -> reward`` or ``-> EpisodeOutcome`` (module docstring)."""


class EnvironmentLoadError(ValueError):
    """An environment named in the config cannot be loaded; the message names it and what was expected."""


def import_environment(spec: str) -> Environment:
    """The async function ``"package.module:function"`` names (the run's own config names it: the
    same trust as the config file itself).

    Raises:
        EnvironmentLoadError: not ``module:function``, the module does not import, it has no such
            attribute, or the attribute is not an async function (nor an object with an async
            ``__call__``).
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute.isidentifier():
        raise EnvironmentLoadError(f"task.environment = {spec!r}: expected 'package.module:function', 'calculator' "
                                "or 'verifiers:<taskset id>'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvironmentLoadError(f"task.environment = {spec!r}: module {module_name!r} does not import ({e})") from e
    function = getattr(module, attribute, None)
    if not callable(function):
        raise EnvironmentLoadError(f"task.environment = {spec!r}: {module_name} has no function {attribute!r}")
    if not (inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__)):
        raise EnvironmentLoadError(f"task.environment = {spec!r}: not an async function; expected "
                                   "'async def f(client, prompt)' returning the episode's reward")
    return function
