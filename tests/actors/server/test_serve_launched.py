"""``specroll serve`` and ``specroll launch`` with ``[server]`` as a user starts them: the launcher
starts the server (or the trainer with the server beside it) and two generators, the server's URL
appears in ``RUN_DIR/server.url``, the real ``openai`` client gets replies, a weight update over HTTP
moves the policy (or is refused while a trainer owns it), and Ctrl-C ends everything with 130."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package depends on
import openai
import pytest
from helpers.launch import assert_nothing_left, children_of, finish, generators_connected, wait_for, write_config
from helpers.scrape import assert_catalogue, scrape, value
from helpers.timeouts import guard

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = guard(120)


def _start(tmp_path: Path, config: Path, *command: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "specroll.actors.cli", *command, "--grace-s", "60",
           "--set", "server.port=0", "--set", "server.enabled=true", "--set", "metrics.enabled=true",
           "--set", "metrics.port=0"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _url(run_dir: Path, proc: subprocess.Popen[str]) -> str:
    url_file = run_dir / "server.url"
    wait_for(url_file.exists, "RUN_DIR/server.url", proc)
    wait_for(lambda: generators_connected(run_dir, 2), "both generators to connect", proc)
    return url_file.read_text().strip()


def _interrupt(proc: subprocess.Popen[str], run_dir: Path, before: set[int]) -> None:
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 130, err
    assert "interrupted by SIGINT" in err
    assert_nothing_left(run_dir, before)


def test_specroll_serve_answers_takes_a_weight_update_and_stops_on_ctrl_c(tmp_path: Path, tiny_checkpoint) -> None:
    model = tiny_checkpoint()
    config = write_config(tmp_path, model, count=2)
    run_dir = tmp_path / "run"
    before = children_of(os.getpid())
    proc = _start(tmp_path, config, "serve", "--config", str(config))
    try:
        url = _url(run_dir, proc)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HANG_S) as api:
            name = api.models.list().data[0].id
            assert name == str(model)
            reply = api.completions.create(model=name, prompt=[5, 6, 7], max_tokens=8, n=2,
                                           extra_body={"ignore_eos": True})
            assert [c.model_extra["token_versions"] for c in reply.choices] == [[0] * 8] * 2
            chat = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
            assert chat.choices[0].message.role == "assistant"
            # The same weights as version 1, from the default weights folder RUN_DIR/weights.
            (run_dir / "weights" / "v1").mkdir()
            shutil.copy(model / "model.safetensors", run_dir / "weights" / "v1")
            update = httpx.post(url.removesuffix("/v1") + "/update_weights", json={"path": "v1"}, timeout=HANG_S)
            assert update.status_code == 200 and update.json() == {"policy_version": 1}
            again = api.completions.create(model=name, prompt=[5, 6, 7], max_tokens=8,
                                           extra_body={"ignore_eos": True})
            assert again.choices[0].model_extra["token_versions"] == [1] * 8
        served = scrape(run_dir, "server")  # /metrics of the server's process: the hub's and the server's
        assert_catalogue(served, "server")
        assert value(served[1], "specroll:server_requests_total") == 3
        assert value(served[1], "specroll:generators_registered") == 2
        for generator in ("generator-0", "generator-1"):
            assert_catalogue(scrape(run_dir, generator), "generator", speculative=False)  # serve: never drafts
    finally:
        _interrupt(proc, run_dir, before)


def test_launch_with_a_server_serves_beside_training_and_refuses_weight_updates(tmp_path: Path,
                                                                                  tiny_checkpoint) -> None:
    config = write_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=2)
    run_dir = tmp_path / "run"
    before = children_of(os.getpid())
    proc = _start(tmp_path, config, "launch", str(config))
    try:
        url = _url(run_dir, proc)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HANG_S) as api:
            name = api.models.list().data[0].id
            reply = api.completions.create(model=name, prompt=[5, 6, 7], max_tokens=8,
                                           extra_body={"ignore_eos": True})
            assert len(reply.choices[0].model_extra["token_versions"]) == 8
        update = httpx.post(url.removesuffix("/v1") + "/update_weights", json={"path": "v1"}, timeout=HANG_S)
        assert update.status_code == 409 and update.json()["error"]["code"]
        trainer = scrape(run_dir, "trainer")  # the trainer's /metrics holds its server's too
        assert_catalogue(trainer, "trainer", "server")
        assert value(trainer[1], "specroll:server_requests_total") == 1
    finally:
        _interrupt(proc, run_dir, before)
