"""``specroll keys init RUN_DIR``: make a run's CURVE keys (``protocol/curve.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_REFUSED
from specroll.protocol.curve import CLIENT_ROLES, KEYS_DIRNAME, KeysError, files_for, init_keys


def run_keys_init(run_dir: str | None, out: str | None = None) -> int:
    """Make the keys in ``out`` (default ``RUN_DIR/keys``), or keep a complete keys folder after
    checking it (:func:`~specroll.protocol.curve.check_keys`); print where they are and which files
    each host needs; return the exit code (2: neither a run directory nor ``out``, an incomplete or
    inconsistent keys folder, a file in the way, an unwritable place — nothing is written then)."""
    if (run_dir is None and out is None) or any(v is not None and not v.strip() for v in (run_dir, out)):
        print("specroll keys init: error: expected a run directory or --out DIR (not empty)", file=sys.stderr)
        return EXIT_REFUSED
    directory = Path(out).expanduser() if out is not None else Path(run_dir or "") / KEYS_DIRNAME
    try:
        made = init_keys(directory)
    except KeysError as e:
        print(f"specroll keys init: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"{'made' if made else 'kept'} the run's CURVE keys in {directory}")
    print(f"  trainer's host: {', '.join(files_for('trainer'))}")
    for role in CLIENT_ROLES:
        who = "generators" if role == "generator" else "drafter trainer"
        print(f"  {who}: {', '.join(files_for(role))}")
    print("  start each role with --keys DIR (or network.security = 'curve' and network.keys_dir = DIR)")
    return EXIT_OK
