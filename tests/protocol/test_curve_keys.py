"""CURVE keys (``network.security = "curve"``): the run's keys on disk (modes, kept or refused
whole), ``specroll keys init``, ``--keys`` and ``network.keys_dir``, the config's rules, the
refusal log's bound."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from helpers.timeouts import guard

from specroll.protocol.curve import (
    MAX_LOGGED_REFUSALS,
    ClientKeys,
    KeysError,
    RefusalLog,
    ServerKeys,
    all_files,
    files_for,
    init_keys,
)

HANG_S = guard(120)  # a hang guard only: every wait below ends on an event


# ---- keys on disk -------------------------------------------------------------------------------


def test_init_makes_a_private_folder_of_certificates_and_keeps_a_complete_one(tmp_path: Path) -> None:
    keys = tmp_path / "run" / "keys"
    assert init_keys(keys) is True
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert sorted(p.name for p in keys.iterdir()) == sorted(all_files())
    assert {stat.S_IMODE(p.stat().st_mode) for p in keys.iterdir()} == {0o600}
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    assert init_keys(keys) is False  # a second launch keeps the run's keys
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before
    assert [p.name for p in keys.parent.iterdir()] == ["keys"]  # no temporary folder left
    server = ServerKeys.load(keys)
    assert sorted(server.clients.values()) == ["drafter", "generator"]
    for role in ("generator", "drafter"):
        client = ClientKeys.load(keys, role)
        assert client.server_public == server.public and server.clients[client.public] == role
        assert zmq.curve_public(client.secret) == client.public  # a real key pair


def test_keys_init_command_and_an_incomplete_folder(tmp_path: Path, capsys) -> None:
    from specroll.actors.cli import main

    assert main(["keys", "init", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"made the run's CURVE keys in {tmp_path / 'run' / 'keys'}" in out
    assert "generators: server.key, generator.key_secret" in out
    (tmp_path / "run" / "keys" / "drafter.key").unlink()
    before = sorted(p.name for p in (tmp_path / "run" / "keys").iterdir())
    assert main(["keys", "init", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specroll keys init: error: keys directory") and "lacks drafter.key" in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "run" / "keys").iterdir()) == before  # nothing overwritten
    (tmp_path / "file").write_text("mine")
    assert main(["keys", "init", str(tmp_path), "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["mixed_runs", "garbage", "exposed_secret", "open_folder", "pair_of_another_key"])
def test_a_kept_keys_folder_is_checked_whole(tmp_path: Path, case: str, capsys) -> None:
    """``keys init`` (and the launcher, through ``init_keys``) keeps a complete folder only if every
    key in it is sound: a key pair mixed from two runs, a garbage file, an exposed secret or a folder
    others may write are refused (exit 2, one line), nothing changed."""
    from specroll.actors.cli import main

    keys = tmp_path / "keys"
    init_keys(keys)
    init_keys(tmp_path / "other")
    expected = {
        "mixed_runs": "generator.key is not the public key of generator.key_secret",
        "garbage": "drafter.key: not a ZeroMQ certificate",
        "exposed_secret": "server.key_secret has mode 0644",
        "open_folder": "has mode 0777: others may replace its keys",
        "pair_of_another_key": "generator.key_secret: its public key is not the one of its secret key",
    }[case]
    if case == "mixed_runs":
        (keys / "generator.key_secret").write_bytes((tmp_path / "other" / "generator.key_secret").read_bytes())
    elif case == "garbage":
        (keys / "drafter.key").write_text("garbage\n")
    elif case == "exposed_secret":
        (keys / "server.key_secret").chmod(0o644)
    elif case == "open_folder":
        keys.chmod(0o777)
    else:  # a secret file whose public line names another key
        text = (keys / "generator.key_secret").read_text()
        public = text.split('public-key = "')[1][:40]
        other = (tmp_path / "other" / "generator.key").read_text().split('public-key = "')[1][:40]
        (keys / "generator.key_secret").write_text(text.replace(public, other))
    before = {f.name: f.read_bytes() for f in keys.iterdir()}
    assert main(["keys", "init", "--out", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specroll keys init: error: ") and expected in err and err.count("\n") == 1, err
    assert {f.name: f.read_bytes() for f in keys.iterdir()} == before
    with pytest.raises(KeysError, match=expected):
        init_keys(keys)


def test_keys_dir_and_keys_flag_values(tmp_path: Path, monkeypatch, capsys) -> None:
    from specroll.actors.cli import main
    from specroll.actors.config import ConfigError, RunConfig, load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ['network.keys_dir="~/keys"'])
    assert config.network.keys_path("run") == tmp_path / "keys"
    assert RunConfig().network.keys_path("run") == Path("run") / "keys"
    for blank in ("  ", " keys"):
        with pytest.raises(ConfigError, match="keys_dir"):
            load_config(None, [f'network.keys_dir="{blank}"'])
    with pytest.raises(SystemExit) as exit_:
        main(["generator", "--connect", "tcp://127.0.0.1:5", "--keys", ""])
    assert exit_.value.code == 2 and "--keys: '': expected the directory" in capsys.readouterr().err
    assert main(["keys", "init"]) == 2
    assert "expected a run directory or --out DIR" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["trainer", "generator", "drafter"])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_file_others_may_read_is_refused(tmp_path: Path, role: str, mode: int) -> None:
    init_keys(tmp_path / "keys")
    for name in files_for(role):
        os.chmod(tmp_path / "keys" / name, mode)
        with pytest.raises(KeysError, match=rf"key file .*{name} has mode {mode:04o}: others may read it; "
                                             r"expected 0600 \(chmod 600 "):
            ServerKeys.load(tmp_path / "keys") if role == "trainer" else ClientKeys.load(tmp_path / "keys", role)
        os.chmod(tmp_path / "keys" / name, 0o600)


@pytest.mark.parametrize("case", ["missing", "malformed", "public_only"])
def test_a_missing_or_malformed_key_file_names_the_file(tmp_path: Path, case: str) -> None:
    init_keys(tmp_path / "keys")
    path = tmp_path / "keys" / "generator.key_secret"
    if case == "missing":
        path.unlink()
        expected = r"generator.key_secret not found; expected the run's keys"
    elif case == "malformed":
        path.write_text("curve\n    secret-key = \"short\"\n")
        expected = r"generator.key_secret: (not a ZeroMQ certificate|no secret key of 40 z85)"
    else:
        path.write_bytes((tmp_path / "keys" / "generator.key").read_bytes())
        expected = r"generator.key_secret: no secret key of 40 z85 characters"
    with pytest.raises(KeysError, match=expected):
        ClientKeys.load(tmp_path / "keys", "generator")


@pytest.mark.integration
def test_a_role_with_a_missing_key_exits_2_in_one_line_before_opening_a_socket(tmp_path: Path,
                                                                               tiny_checkpoint) -> None:
    init_keys(tmp_path / "keys")
    (tmp_path / "keys" / "server.key").unlink()
    listener = socket.create_server(("127.0.0.1", 0))  # a port nobody else listens on: a connect would show here
    listener.settimeout(0)
    port = listener.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "specroll.actors.generator", "--connect", f"tcp://127.0.0.1:{port}",
                               "--model", str(tiny_checkpoint("llama")), "--keys", str(tmp_path / "keys")],
                              capture_output=True, text=True, timeout=HANG_S)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the generator never connected
    finally:
        listener.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("specroll generator: error: key file ") and "server.key not found" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_a_non_loopback_host_needs_curve_or_an_explicit_allow_insecure() -> None:
    from specroll.actors.config import NetworkConfig, RunConfig

    with pytest.raises(ValueError, match=r"host='0.0.0.0', expected a loopback address .* unless "
                                         r"security = 'curve' \(or allow_insecure = true"):
        NetworkConfig(host="0.0.0.0")
    assert NetworkConfig(host="0.0.0.0", security="curve").insecure_warning() is None
    [warning] = RunConfig(network=NetworkConfig(host="0.0.0.0", allow_insecure=True)).warnings()
    assert "nothing is authenticated or encrypted" in warning and "feed training fabricated rollouts" in warning
    assert "network.security = 'curve'" in warning
    assert RunConfig(network=NetworkConfig(allow_insecure=True)).warnings() == []  # loopback: no risk named


def test_the_refusal_log_says_each_refusal_once_and_bounds_its_memory(caplog) -> None:
    refusals = RefusalLog(logging.getLogger("test.refusals"))
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(5):
            refusals.refused("a", "refused a")
        for i in range(10 * MAX_LOGGED_REFUSALS):
            refusals.refused(f"k{i}", f"refused k{i}")
    assert refusals.count == 5 + 10 * MAX_LOGGED_REFUSALS
    assert [r.getMessage() for r in caplog.records].count("refused a (logged once)") == 1
    assert len(caplog.records) == MAX_LOGGED_REFUSALS + 1  # the cap, and the line saying so
    assert len(refusals.seen) == MAX_LOGGED_REFUSALS + 1
