"""One factor for every hang guard in the process tests.

A hang guard is the time a test gives a real process (a launched run, an actor, a CLI job) before it
calls the wait a hang and fails. No test asserts a duration: a guard only ends a test that would
otherwise wait forever. Every guard is written as ``guard(seconds)``, where ``seconds`` is sized for
this project's CI machine (2 CPU cores, possibly beside other load), and the factor scales them all
at once: ``pytest --timeout-factor 3`` on a slower or busier machine (docs/getting-started.md).
"""

from __future__ import annotations

FACTOR: float = 1.0
"""Set once per session from ``--timeout-factor`` (tests/conftest.py); 1.0 unless given."""


def guard(seconds: float) -> float:
    """``seconds`` × the session's ``--timeout-factor``: the hang guard to pass as a timeout."""
    return seconds * FACTOR
