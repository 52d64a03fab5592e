"""The built wheel installs the four packages under ``specroll.*`` and the console script."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here starts a process

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
    for package in ("engine", "actors", "drafter", "protocol", "rl"):
        assert f"specroll/{package}/__init__.py" in names
    assert "specroll/__init__.py" in names
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


def test_a_specroll_folder_in_the_working_directory_does_not_shadow_the_install(tmp_path: Path) -> None:
    # specroll is a regular package: a user's own specroll/ folder (no __init__.py) in the working
    # directory must not become a namespace portion that hides the installed specroll.engine.
    (tmp_path / "specroll").mkdir()
    (tmp_path / "specroll" / "engine.py").write_text("SHADOW = True\n")
    code = "import specroll.engine as e; print(e.__file__); print(hasattr(e, 'SHADOW'))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    path, shadowed = out.stdout.split()
    assert shadowed == "False" and not path.startswith(str(tmp_path)), out.stdout


def _specroll_imports(source: str) -> set[str]:
    """The specroll modules a piece of Python source imports from."""
    import ast

    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specroll"):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.startswith("specroll"))
    return modules


def test_the_embedding_examples_import_from_two_modules_and_those_load_lazily() -> None:
    import re

    example = (ROOT / "examples" / "external_trainer.py").read_text()
    pages = [ROOT / "README.md", ROOT / "docs" / "embedding.md"]
    snippets = [s for page in pages for s in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
    embedding = [s for s in snippets if "RolloutClient" in s or "engine.add_request" in s]
    assert len(embedding) >= 3, "the embedding snippets of the README and docs/embedding.md are gone"
    for source in (example, *embedding):
        assert _specroll_imports(source) <= {"specroll.engine", "specroll.actors"}, _specroll_imports(source)
    # Every exported name resolves, and importing the two packages alone loads no torch.
    code = ("import sys, specroll.actors as a, specroll.engine as e; assert 'torch' not in sys.modules, 'eager';"
            "[getattr(m, n) for m in (a, e) for n in m.__all__]; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
