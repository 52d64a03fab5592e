"""One factor for every hang guard in the process tests.

A hang guard is the time a test gives a real process (a launched run, an actor, a CLI job) before it
calls the wait a hang and fails. No test asserts a duration: a guard only ends a test that would
otherwise wait forever. Every guard is written as ``guard(seconds)``, where ``seconds`` is sized for
this project's CI machine (2 CPU cores, possibly beside other load), and the factor scales them all
at once: ``pytest --timeout-factor 3`` on a slower or busier machine (docs/getting-started.md).

A guard is scaled once, where its number is written (``HANG_S = guard(60)``, ``timeout=guard(300)``);
a helper takes the seconds it is given as they are, and scales only its own defaults.
"""

from __future__ import annotations

FACTOR: float | None = None
"""Set once per session from ``--timeout-factor`` (tests/conftest.py ``pytest_configure``, before any
test module is imported); 1.0 unless given."""


def guard(seconds: float) -> float:
    """``seconds`` × the session's ``--timeout-factor``: the hang guard to pass as a timeout.

    Raises:
        RuntimeError: called before pytest configured the factor (at the import of a module that
            conftest.py imports itself).
    """
    if FACTOR is None:
        raise RuntimeError("guard() before pytest_configure set the --timeout-factor")
    return seconds * FACTOR
