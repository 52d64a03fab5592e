"""The ``specroll`` command line refusing bad arguments before anything starts: a peer's ``--connect``
endpoint, an unknown flag named with its subcommand's usage; and what ``--help`` says
(``specroll.actors.cli.main`` in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("command", [["drafter", "serve"], ["generator"]])
@pytest.mark.parametrize(("endpoint", "words"), [
    ("tcp://127.0.0.1:99999", "port '99999', expected an integer in [1, 65535]"),
    ("tcp://127.0.0.1:0", "port '0', expected an integer in [1, 65535]"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555"),
    ("tcp://no such host:5555", "host 'no such host', expected a host name or an IP address (letters, digits, "
                                "'.', '-', '_'; an IPv6 address in brackets)"),  # ZeroMQ: EINVAL at connect
])
def test_a_bad_connect_endpoint_is_refused_before_anything_waits(tmp_path: Path, capsys, command: list[str],
                                                                   endpoint: str, words: str) -> None:
    """ZeroMQ accepts port 99999 or 0 and a peer would wait out its trainer timeout: refused at once."""
    from specroll.actors.cli import main

    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[model]\nname = "{tmp_path / "no-model"}"\n')
    assert main([*command, "--config", str(config), "--connect", endpoint]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"specroll {' '.join(command)}: error: --connect {endpoint!r}: {words}", err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["launch"], ["serve", "--config"]])
def test_a_missing_config_is_named_by_the_command_that_read_it(tmp_path: Path, capsys, command: list[str]) -> None:
    """``specroll serve`` runs the launcher's checks; its errors still say ``specroll serve``."""
    from specroll.actors.cli import main

    missing = tmp_path / "nope.toml"
    assert main([*command, str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"specroll {command[0]}: error: {missing}: config file not found", err


@pytest.mark.parametrize("argv, usage", [
    (["drafter", "init", "--bogus"], "specroll drafter init"),
    (["launch", "run.toml", "--bogus"], "specroll launch"),
    (["report", "RUN", "--bogus", "x"], "specroll report"),
])
def test_an_unknown_flag_is_named_with_its_subcommands_usage(argv: list[str], usage: str, capsys) -> None:
    from specroll.actors.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ") and f"{usage}: error: unrecognized arguments: " in err, err


def test_help_says_what_launch_starts_and_what_a_generator_reads(capsys) -> None:
    from specroll.actors.cli import main

    def help_of(*command: str) -> str:
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines

    top, launch, generator = help_of(), help_of("launch"), help_of("generator")
    assert "the drafter trainer" in top, top
    assert "drafter trainer" in launch and "restarted" in launch and "launch.max_restarts" in launch, launch
    assert "[drafter]" in generator, generator
