"""The manual: the generated configuration reference is current, the site builds with
``mkdocs build --strict``, and the README stays a front door into it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from helpers.timeouts import guard

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCRIPT = ROOT / "scripts" / "config_reference.py"


def _reference(name: str = "config_reference") -> ModuleType:
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_what_the_generator_writes_now() -> None:
    reference = _reference()
    committed = reference.PAGE.read_text() if reference.PAGE.exists() else ""
    assert committed == reference.render(), (
        f"docs/configuration.md differs from what the generator writes from the schema now: regenerate it "
        f"with `{reference.COMMAND}` "
        "and commit the result")


@pytest.mark.integration  # runs the script as a process
def test_the_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    reference = _reference()
    stale = tmp_path / "configuration.md"
    stale.write_text(reference.render().replace("| `batch_groups` |", "| `batch_groups_old` |"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", "--out", str(stale)], capture_output=True,
                          text=True, timeout=guard(120))
    assert proc.returncode == 1 and "python scripts/config_reference.py" in proc.stderr, proc.stderr
    fresh = tmp_path / "fresh.md"
    fresh.write_text(reference.render())
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", "--out", str(fresh)], capture_output=True,
                          text=True, timeout=guard(120))
    assert proc.returncode == 0, proc.stderr


def _dotted_keys(table: dict[str, object], prefix: str = "") -> set[str]:
    keys = set()
    for name, value in table.items():
        if isinstance(value, dict):
            keys |= _dotted_keys(value, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_the_reference_has_one_row_for_every_key_of_the_run_config() -> None:
    from specroll.actors.config import RunConfig

    reference = _reference()
    rows = {".".join((*s.path, k.name)) for s in reference.sections() for k in s.keys}
    # An independent walk: every leaf of the default config as plain data (None included).
    assert rows == _dotted_keys(_builtins(RunConfig()))
    page = reference.render()
    for heading in ("## `[trainer]` {#trainer}", "## `[generator.engine]` {#generator-engine}",
                    "## `[cluster.drafter]` {#cluster-drafter}"):
        assert heading in page
    assert "| `max_staleness` | integer | `1` | η: most policy versions a trained token may lag" in page
    assert "| `prompts` | string (optional) | unset |" in page


def _builtins(struct: msgspec.Struct) -> dict[str, object]:
    """Every field of ``struct``, nested structs as dicts, ``None`` kept (``msgspec.to_builtins`` would
    drop nothing either, but this walk shares no code with the generator's)."""
    return {f.name: (_builtins(v) if isinstance(v := getattr(struct, f.name), msgspec.Struct) else v)
            for f in msgspec.structs.fields(struct)}


class _Documented(msgspec.Struct, frozen=True, kw_only=True):
    """A section whose keys are documented."""

    size: int = 1
    """How many."""


class _Undocumented(msgspec.Struct, frozen=True, kw_only=True):
    """A root with one documented section and one bare key."""

    inner: _Documented = _Documented()
    bare: str = "x"


def test_a_key_without_a_docstring_is_an_error_naming_it() -> None:
    reference = _reference()
    found = reference.sections(_Documented)
    assert [(k.name, k.type, k.default, k.doc) for k in found[0].keys] == [("size", "integer", "`1`", "How many.")]
    with pytest.raises(reference.MissingDocstring, match="'bare'"):
        reference.sections(_Undocumented)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_no_tracker_numbers_and_no_workspace_paths_in_the_user_docs() -> None:
    tracker = re.compile(r"\bissues? \d+|\(#\d+\)", re.I)
    for page in _pages():
        text = page.read_text()
        assert not tracker.findall(text), (page.name, tracker.findall(text))
        assert "../shared" not in text, page.name


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test"], commands
    # Every relative link goes to a file that exists (mkdocs checks docs/; nothing checks the README).
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


@pytest.mark.slow
@pytest.mark.integration  # runs mkdocs as a process
def test_the_site_builds_with_mkdocs_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=guard(300),
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_the_metrics_page_lists_every_exported_metric_with_its_type() -> None:
    from specroll.actors.telemetry import catalogue

    script = _reference("metrics_reference")
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert script.render(page) == page, "docs/metrics.md is stale: run python scripts/metrics_reference.py"
    rows = dict(re.findall(r"^\| `([a-z0-9_:]+)` \| (counter|gauge|histogram) \|", page, re.M))
    assert rows == {m.exposed: m.kind for m in catalogue.ALL}
