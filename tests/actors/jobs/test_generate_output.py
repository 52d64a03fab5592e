"""``specroll generate`` run in-process: base models, output file mode and early failures."""

from __future__ import annotations

import json
import os
import stat

from specroll.actors.cli import main


def _args(model, out, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--out", str(out), "--num-builtin", "2", "--n", "2",
            "--max-tokens", "4", "--dtype", "float32", "--no-progress", *extra]


def test_a_base_model_without_chat_template_gets_plain_prompts(tiny_checkpoint, tmp_path, capsys):
    path = tiny_checkpoint("llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out.jsonl"
    assert main(_args(path, out)) == 0
    assert "no chat template" in capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    assert "<|im_start|>" not in json.dumps(records)  # no template markup was invented


def test_output_gets_the_usual_file_mode_and_null_reward_without_answer(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n")
    out = tmp_path / "new" / "out.jsonl"
    old = os.umask(0o022)
    try:
        assert main(_args(tiny_checkpoint("llama"), out, "--prompts", str(prompts))) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert all(json.loads(line)["reward"] is None for line in out.read_text().splitlines())


def test_unwritable_output_fails_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    # The model path does not exist either: the output error must come first, before any loading.
    rc = main(_args(tmp_path / "no-such-model", blocker / "sub" / "out.jsonl"))
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write there" in err and "no-such-model" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_failed_run_removes_the_folders_it_made(tmp_path, capsys):
    out = tmp_path / "deep" / "er" / "out.jsonl"
    assert main(_args(tmp_path / "no-such-model", out)) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_parent_folder_removed_by_a_concurrent_run_is_made_again(tmp_path, monkeypatch):
    # Two runs writing under one new folder: the other one's failed run removes the shared parent
    # between our finding it and making our own folder in it.
    from pathlib import Path

    from specroll.actors.jobs.generate import _AtomicOutput

    shared = tmp_path / "out"
    shared.mkdir()
    out = shared / "ours" / "rollouts.jsonl"
    mkdir = Path.mkdir
    removed = []

    def racing_mkdir(self: Path, *args, **kwargs) -> None:
        if self == out.parent and not removed:
            shared.rmdir()
            removed.append(shared)
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    with _AtomicOutput(out) as output:
        output.commit([])
    assert removed and out.read_bytes() == b""
