"""The built wheel installs the four packages under ``specroll.*`` and the console script."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_imports_outside_the_source_tree(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(ROOT)],
        check=True, cwd=tmp_path,
    )
    (wheel,) = wheels.glob("specroll-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("engine", "actors", "drafter", "protocol"):
        assert f"specroll/{package}/__init__.py" in names
    assert not any(n.startswith("tests/") or n.startswith("benchmarks/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specroll = specroll.actors.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    # The editable install's path hooks must not satisfy the import: run with -S-like isolation by
    # putting the wheel's files first and importing from a directory outside the checkout.
    code = (
        "import specroll.engine.engine, specroll.actors.cli, specroll.protocol.sampling, specroll.drafter;"
        "import specroll.engine as e; print(e.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env=env)
    assert out.stdout.strip().startswith(str(site)), out.stdout
