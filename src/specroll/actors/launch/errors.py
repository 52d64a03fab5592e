"""The launcher's one error type, shared by the launcher and its preflight checks."""

from __future__ import annotations

from specroll.actors.shared.exit_codes import EXIT_FAILED


class LaunchError(Exception):
    """The run cannot go on: a one-line reason (plus an optional log tail) and the exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED, detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail
