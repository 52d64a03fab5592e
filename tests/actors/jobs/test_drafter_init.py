"""``specroll drafter init``: a warm-start drafter made once per key and found again in the cache."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import msgspec
import pytest
from helpers.warm_start import TINY_WARM_START, snapshot, warm_start_config

from specroll.actors.cli import main
from specroll.actors.jobs.drafter_cache import RECORD_FILE, read_record, training_prompts, warm_start_key
from specroll.actors.jobs.drafter_init import make_warm_start
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.checkpoint import load_model_config


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _init(model: Path, cache: Path, *extra: str) -> list[str]:
    return ["drafter", "init", "--model", str(model), "--cache-dir", str(cache), "--threads", "1",
            *_sets(TINY_WARM_START), *extra]


def _scramble_keeping_stamps(path: Path) -> None:
    """Overwrite ``path`` with as many garbage bytes, keeping its modification time: its stamp in a
    key is unchanged, but reading it fails."""
    st = os.stat(path)
    path.write_bytes(b"\xff" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_second_init_is_a_cache_hit_that_reads_no_model(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    model, cache = tmp_path / "model", tmp_path / "cache"
    shutil.copytree(tiny_llama, model)  # copy2: the same stamps; ours to scramble
    assert main(_init(model, cache)) == 0
    out, err = capsys.readouterr()
    folder = Path(out.strip())
    assert folder.parent == cache and "cache miss" in err, err
    head = EagleHead.load(folder)
    head.check_target(load_model_config(model), "the warm start")
    assert head.config.draft_vocab_size == 64
    record = read_record(folder)
    assert record.key == folder.name and record.inputs.rollouts == 4 and record.made.train_steps >= 1
    before = snapshot(cache)

    for name in ("config.json", "model.safetensors"):  # a hit must not load them
        _scramble_keeping_stamps(model / name)
    assert main(_init(model, cache)) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()) == folder and "cache hit" in err and "miss" not in err, err
    assert snapshot(cache) == before  # nothing rewritten: the same bytes and times
    lines: list[str] = []
    config = warm_start_config(model, tmp_path / "run", cache)
    again = make_warm_start(config, config.drafter.warm_start_minutes, 4, cache, threads=1, say=lines.append)
    assert again.hit and again.path == folder and lines == []  # no "cache miss" / training lines
    # ... and the scrambled model would have failed a miss: another budget is another key.
    assert main(_init(model, cache, "--budget-minutes", "0.01")) == 2
    assert "error" in capsys.readouterr().err


def _key(model: Path, tmp_path: Path, *extra: str, minutes: float = 1.0, rollouts: int = 4) -> str:
    config = warm_start_config(model, tmp_path / "run", tmp_path / "cache", *extra)
    return warm_start_key(config, training_prompts(config), minutes, rollouts).digest()


def test_the_key_follows_what_determines_the_head(tiny_llama: Path, tmp_path: Path) -> None:
    base = _key(tiny_llama, tmp_path)
    changed = {
        "task": _key(tiny_llama, tmp_path, "task.digits=2"),
        "operators": _key(tiny_llama, tmp_path, "task.operators=\"+\""),
        "prompt count": _key(tiny_llama, tmp_path, "task.builtin_count=32"),
        "draft vocabulary": _key(tiny_llama, tmp_path, "drafter.draft_vocab_size=32"),
        "architecture": _key(tiny_llama, tmp_path, "drafter.architecture=\"eagle\""),
        "taps": _key(tiny_llama, tmp_path, "drafter.features=\"last\""),
        "learning rate": _key(tiny_llama, tmp_path, "drafter.learning_rate=0.01"),
        "window": _key(tiny_llama, tmp_path, "drafter.window_tokens=32"),
        "temperature": _key(tiny_llama, tmp_path, "generator.sampling.temperature=0.5"),
        "max tokens": _key(tiny_llama, tmp_path, "generator.sampling.max_tokens=7"),
        "seed": _key(tiny_llama, tmp_path, "seed=1"),
        "budget": _key(tiny_llama, tmp_path, minutes=2.0),
        "rollouts": _key(tiny_llama, tmp_path, rollouts=5),
    }
    assert all(k != base for k in changed.values()), [name for name, k in changed.items() if k == base]
    assert len(set(changed.values())) == len(changed)
    # What does not shape the head keeps the key: the trainer's settings, the generators, the schedule.
    for same in ("trainer.learning_rate=0.001", "generator.count=3", "drafter.publish_every_steps=7",
                 "drafter.duty_cycle=0.3", "steps=99"):
        assert _key(tiny_llama, tmp_path, same) == base, same
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    copied = _key(model, tmp_path)
    st = os.stat(model / "model.safetensors")
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten
    assert copied != base and _key(model, tmp_path) != copied


@pytest.mark.parametrize(("args", "message"), [
    (["--budget-minutes", "0"], "not a positive number"),
    (["--budget-minutes", "-1"], "not a positive number"),
    (["--budget-minutes", "nan"], "not a positive number"),
    (["--rollouts", "0"], "not a positive integer"),
    (["--set", "drafter.warm_start_minutes=0"], "no training budget"),
    (["--set", "drafter.warm_start_minutes=-2"], "drafter.warm_start_minutes=-2.0, expected"),
    (["--set", "drafter.draft_vocab_size=1000"], "exceeds the vocabulary"),
    (["--prompts", "missing.jsonl"], "missing.jsonl"),
    (["--budget-minutes", "1", "--set", "drafter.warm_start_minutes=0", "--set", "task.environment=\"calculator\""],
     "single-turn"),
], ids=["zero", "negative", "nan", "no-rollouts", "no-budget", "bad-config", "vocab", "prompts", "episodes"])
def test_bad_inputs_exit_2_with_a_clear_message_and_write_nothing(tiny_llama: Path, tmp_path: Path, capsys,
                                                                  args: list[str], message: str) -> None:
    cache = tmp_path / "cache"
    try:
        code = main(_init(tiny_llama, cache, *args))
    except SystemExit as e:  # argparse's refusal
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "error" in err, err
    assert not cache.exists()


def test_a_cache_folder_without_its_record_is_made_again(tiny_llama: Path, tmp_path: Path) -> None:
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache")
    first = make_warm_start(config, config.drafter.warm_start_minutes, 4, tmp_path / "cache", threads=1,
                            say=lambda _: None)
    (first.path / RECORD_FILE).unlink()  # incomplete: as if written by hand
    again = make_warm_start(config, config.drafter.warm_start_minutes, 4, tmp_path / "cache", threads=1,
                            say=lambda _: None)
    assert not again.hit and again.path == first.path
    assert msgspec.json.decode((again.path / RECORD_FILE).read_bytes())["key"] == first.path.name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f".{first.path.name}.lock", first.path.name]


def test_two_concurrent_inits_make_one_head(tiny_llama: Path, tmp_path: Path) -> None:
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache")
    results, errors = [], []

    def init() -> None:
        try:
            results.append(make_warm_start(config, config.drafter.warm_start_minutes, 4, tmp_path / "cache",
                                           threads=1, say=lambda _: None))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=init) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(r.hit for r in results) == [False, True]  # the second waited for the first's lock
    assert results[0].path == results[1].path and results[0].record == results[1].record
