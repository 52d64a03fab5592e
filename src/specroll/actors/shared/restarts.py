"""``RUN_DIR/restarts.json``: how often ``specroll launch`` restarted each role of the run.

The launcher writes it (atomically) at every restart; the trainer copies it into each metrics line
(``restarts``: the total, ``restarts_by_role``), so a restart is visible where the run's figures are.
"""

from __future__ import annotations

import json
from pathlib import Path

from specroll.actors.shared.files import write_text_atomic

RESTARTS_FILENAME = "restarts.json"


def write_restarts(run_dir: Path, by_role: dict[str, int]) -> None:
    """Record the restart count of every role (``{"generator-0": 2, "trainer": 1}``)."""
    record = {"restarts": sum(by_role.values()), "restarts_by_role": dict(sorted(by_role.items()))}
    write_text_atomic(run_dir / RESTARTS_FILENAME, json.dumps(record) + "\n")


def read_restarts(run_dir: Path) -> dict[str, object]:
    """``{"restarts": N, "restarts_by_role": {...}}`` as last written; zero restarts when there is no
    file (nothing was restarted, or the run was not launched) or it cannot be read."""
    try:
        record = json.loads((run_dir / RESTARTS_FILENAME).read_text())
    except (OSError, ValueError):
        return {"restarts": 0, "restarts_by_role": {}}
    by_role = record.get("restarts_by_role") if isinstance(record, dict) else None
    if not isinstance(by_role, dict) or not all(isinstance(v, int) for v in by_role.values()):
        return {"restarts": 0, "restarts_by_role": {}}
    return {"restarts": sum(by_role.values()), "restarts_by_role": by_role}
