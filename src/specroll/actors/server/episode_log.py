"""The turns of the episodes a trainer runs through the server, recorded as the server ran them.

A trainer that runs environments against the server (``specroll.actors.trainer.episodes``) opens an
episode under a fresh ``X-Session-ID`` before its environment starts and closes it when the
environment returned its reward: every chat or completion request of that session in between is
one :class:`~specroll.rl.episodes.Turn` — the exact prompt token ids the generator was given and the
token ids, behavior logprobs and policy versions it produced (chat requests: ``/v1/completions`` and
``/inference/v1/generate`` turns are not recorded). Sessions nobody opened are not recorded. Bounded:
at most ``max_open`` episodes open, each at most ``max_turns`` turns (a turn past it marks the episode
``overflowed`` instead of growing it), and an episode opened with a ``limit`` has its requests past
``limit`` turns refused before they run (:meth:`full`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specroll.rl.episodes import Turn


class EpisodeLogError(RuntimeError):
    """An episode cannot be opened (already open, or too many open)."""


@dataclass
class _Open:
    turns: list[Turn] = field(default_factory=list)
    overflowed: bool = False
    limit: int | None = None
    aliases: list[str] = field(default_factory=list)


class EpisodeLog:
    """Open episodes by session id (module docstring).

    Args:
        max_open: most episodes open at once.
        max_turns: most turns recorded per episode.
    """

    def __init__(self, max_open: int = 65536, max_turns: int = 256) -> None:
        self.max_open, self.max_turns = max_open, max_turns
        self._open: dict[str, _Open] = {}

    def open(self, session_id: str, limit: int | None = None) -> None:
        """Record the turns of ``session_id`` from now on; with ``limit``, refuse its requests once it
        has that many turns (:meth:`full`).

        Raises:
            EpisodeLogError: it is open already, or ``max_open`` are.
        """
        if session_id in self._open:
            raise EpisodeLogError(f"episode {session_id!r} is open already")
        if len(self._open) >= self.max_open:
            raise EpisodeLogError(f"{len(self._open)} episodes are open, the limit is {self.max_open}")
        self._open[session_id] = _Open(limit=limit)

    def full(self, session_id: str | None) -> int | None:
        """The turn limit of ``session_id``'s open episode when it has reached it (its next request
        must not run), else None."""
        episode = self._open.get(session_id) if session_id is not None else None
        if episode is None or episode.limit is None or len(episode.turns) < episode.limit:
            return None
        return episode.limit

    def attach(self, session_id: str, other: str) -> None:
        """Record the turns of session ``other`` in the open episode ``session_id`` too (an
        environment whose client sets its own ``X-Session-ID``, e.g. ``verifiers``' trace id).

        Raises:
            EpisodeLogError: ``session_id`` is not open, ``other`` is open already, or ``max_open``
                sessions are recorded.
        """
        episode = self._open.get(session_id)
        if episode is None:
            raise EpisodeLogError(f"episode {session_id!r} is not open")
        if other in self._open:
            raise EpisodeLogError(f"session {other!r} is recorded already")
        if len(self._open) >= self.max_open:
            raise EpisodeLogError(f"{len(self._open)} sessions are recorded, the limit is {self.max_open}")
        self._open[other] = episode
        episode.aliases.append(other)

    def add(self, session_id: str | None, turn: Turn) -> None:
        """A turn of ``session_id`` ended: recorded when its episode is open, else ignored."""
        episode = self._open.get(session_id) if session_id is not None else None
        if episode is None:
            return
        if len(episode.turns) >= self.max_turns:
            episode.overflowed = True
            return
        episode.turns.append(turn)

    def close(self, session_id: str) -> tuple[list[Turn], bool, list[str]]:
        """Stop recording ``session_id``: its turns, whether any was left out past ``max_turns``, and
        the session ids attached to it (an unknown id: no turns, none attached)."""
        episode = self._open.pop(session_id, None)
        if episode is None:
            return [], False, []
        for alias in episode.aliases:
            self._open.pop(alias, None)
        return episode.turns, episode.overflowed, episode.aliases

    def __len__(self) -> int:
        """Sessions recorded (an episode's attached ones included)."""
        return len(self._open)
