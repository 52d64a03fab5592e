"""Run config: defaults are a valid run, TOML round-trips, overrides apply, every error names file and key."""

from __future__ import annotations

import inspect
import os
import tomllib
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from specroll.actors.config import (
    ConfigError,
    DrafterConfig,
    GeneratorConfig,
    ModelSection,
    NetworkConfig,
    RunConfig,
    TaskConfig,
    TrainerConfig,
    dump_config,
    load_config,
    write_resolved,
)
from specroll.engine.config import EngineConfig
from specroll.engine.loaders.registry import DEFAULT_MODEL
from specroll.protocol.sampling import SamplingParams


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _structs(kind: mi.Type) -> list[mi.StructType]:
    """Every struct type in the config tree."""
    if isinstance(kind, mi.UnionType):
        return [s for t in kind.types for s in _structs(t)]
    if not isinstance(kind, mi.StructType):
        return []
    return [kind] + [s for f in kind.fields for s in _structs(f.type)]


# ---- defaults ---------------------------------------------------------------------------------


def test_defaults_are_a_small_valid_cpu_run() -> None:
    config = RunConfig()
    assert load_config(None) == config
    assert config.model.name == DEFAULT_MODEL
    assert config.generator.engine.model == DEFAULT_MODEL
    assert config.generator.engine.device == "cpu"
    assert config.task.prompts is None  # the built-in task
    assert config.generator.count >= 1 and config.steps >= 1
    assert config.trainer.max_groups_in_flight >= config.trainer.batch_groups
    assert config.network.host == "127.0.0.1" and config.network.security == "none"
    assert not config.network.allow_insecure


def test_network_defaults_match_the_socket_layer() -> None:
    from specroll.protocol.channel import DEFAULT_WINDOW
    from specroll.protocol.sockets import DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_HWM

    network = NetworkConfig()
    assert network.hwm == DEFAULT_HWM
    assert network.window == DEFAULT_WINDOW
    assert network.heartbeat_timeout_s == DEFAULT_HEARTBEAT_TIMEOUT_MS / 1000


def test_optional_fields_default_to_none() -> None:
    # dump_config omits None (TOML has no null); that is lossless only if None is the default.
    for struct in _structs(mi.type_info(RunConfig)):
        for field in struct.fields:
            if isinstance(field.type, mi.UnionType) and any(isinstance(t, mi.NoneType) for t in field.type.types):
                assert field.default is None, f"{struct.cls.__name__}.{field.name}"


def test_every_field_is_documented() -> None:
    for cls in (RunConfig, ModelSection, TaskConfig, TrainerConfig, GeneratorConfig, DrafterConfig, NetworkConfig):
        source = inspect.getsource(inspect.getmodule(cls))
        body = source.split(f"class {cls.__name__}(", 1)[1].split("\nclass ", 1)[0]
        for name in cls.__struct_fields__:
            if cls is RunConfig and name in ("model", "task", "trainer", "generator", "drafter", "network"):
                continue  # sections: documented on their own class
            after = body.split(f"\n    {name}: ", 1)[1].split("\n", 2)[1]
            assert after.strip().startswith('"""'), f"{cls.__name__}.{name} has no docstring"


# ---- round trip -------------------------------------------------------------------------------


def _everything_changed() -> RunConfig:
    return RunConfig(
        run_dir='runs/odd "dir" \\ with\ttab\nnewline\x01 é',
        seed=7,
        steps=11,
        model=ModelSection(name="/models/policy.gguf", dtype="bfloat16"),
        task=TaskConfig(prompts="data/gsm8k.jsonl", max_prompts=50, builtin_count=3),
        trainer=TrainerConfig(batch_groups=2, group_size=8, learning_rate=3e-7, weight_decay=0.01, max_grad_norm=0.0,
                              grad_accum_steps=4, loss="ppo", tis_cap=1.5, clip_eps=0.28, max_staleness=0,
                              staleness_policy="drop", normalize_std=False, checkpoint_every=5,
                              weights_dtype="bfloat16", max_groups_in_flight=3, train_threads=2,
                              max_group_retries=5, dropped_prompts="retry", max_queued_groups=4096),
        generator=GeneratorConfig(
            count=2,
            engine=EngineConfig(model="/models/policy.gguf", backend="torch", page_size=32, max_model_len=512,
                                num_threads=1, kv_cache_memory_gb=0.25, draft_length="adaptive"),
            sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.95, max_tokens=64, stop_token_ids=(2, 3)),
            kv_policy="recompute", stream_every_steps=1, heartbeat_s=0.5, speculative="eagle"),
        drafter=DrafterConfig(enabled=True, path="drafters/init", learning_rate=3e-4, window_rollouts=10,
                              publish_every_steps=2),
        network=NetworkConfig(host="0.0.0.0", trainer_port=5555, security="curve", keys_dir="/secrets/run 7",
                              allow_insecure=True, hwm=100, window=8, heartbeat_timeout_s=2.5),
    )


@pytest.mark.parametrize("config", [RunConfig(), _everything_changed()], ids=["defaults", "everything-changed"])
def test_round_trip_through_the_run_dir(tmp_path: Path, config: RunConfig) -> None:
    path = write_resolved(config, tmp_path / "run")
    assert path == tmp_path / "run" / "config.toml"
    assert load_config(path) == config
    # The file is plain TOML that any parser reads back to the same values (None omitted).
    assert tomllib.loads(path.read_text()) == _as_toml(msgspec.to_builtins(config))


def _as_toml(value: object) -> object:
    """What TOML can hold: no None (omitted), arrays as lists."""
    if isinstance(value, dict):
        return {k: _as_toml(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_as_toml(v) for v in value]
    return value


def test_write_resolved_defaults_to_the_configs_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["run_dir=runs/exp1"])
    path = write_resolved(config)
    assert path.resolve() == (tmp_path / "runs" / "exp1" / "config.toml").resolve()
    assert load_config(path) == config


def test_dump_writes_scalars_before_tables_and_omits_none() -> None:
    text = dump_config(RunConfig())
    assert text.index("steps = 3") < text.index("[model]")
    assert "[generator.engine]" in text and "[generator.sampling]" in text
    assert "max_model_len" not in text and "prompts" not in text.split("[task]")[1].split("[")[0]


# ---- overrides --------------------------------------------------------------------------------


def test_overrides_apply_on_top_of_the_file_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, "steps = 5\n[trainer]\ngroup_size = 8\nbatch_groups = 2\n"
                            "[generator.engine]\npage_size = 8\n")
    config = load_config(path, [
        "trainer.group_size=6",
        "generator.engine.page_size = 32",  # spaces around '=' are fine
        "generator.sampling.stop_token_ids=[1, 2]",
        "generator.sampling.temperature=0.5",
        "drafter.enabled=true",
        'model.name="/m/x.gguf"',
        "task.prompts=data/gsm8k.jsonl",  # a bare word that is not TOML: a string
        "run_dir=runs/a-b",
        "steps=7",
        "steps=9",  # the last one wins
    ])
    assert config.steps == 9
    assert config.trainer.group_size == 6 and config.trainer.batch_groups == 2  # file value kept
    assert config.generator.engine.page_size == 32
    assert config.generator.sampling.stop_token_ids == (1, 2)
    assert config.generator.sampling.temperature == 0.5
    assert config.drafter.enabled is True
    assert config.task.prompts == "data/gsm8k.jsonl"
    assert config.run_dir == "runs/a-b"
    assert config.model.name == "/m/x.gguf"
    assert config.generator.engine.model == "/m/x.gguf"  # the engine serves the policy


def test_override_with_an_inline_table() -> None:
    config = load_config(None, ["network={host = \"localhost\", trainer_port = 7000}"])
    assert config.network.host == "localhost" and config.network.trainer_port == 7000


def test_engine_model_follows_model_name_and_a_conflict_is_an_error() -> None:
    assert RunConfig(model=ModelSection(name="a.gguf")).generator.engine.model == "a.gguf"
    with pytest.raises(ValueError, match=r"generator.engine.model='b.gguf', expected unset or equal to model.name"):
        RunConfig(model=ModelSection(name="a.gguf"), generator=GeneratorConfig(engine=EngineConfig(model="b.gguf")))


# ---- errors -----------------------------------------------------------------------------------


def test_an_acceptance_floor_up_to_k_plus_1_is_accepted() -> None:
    assert RunConfig(drafter=DrafterConfig(acceptance_floor=5.0)).drafter.acceptance_floor == 5.0  # k = 4: all accepted


def test_a_drafter_trainer_no_generator_drafts_with_is_a_warning() -> None:
    """Valid (a drafter trained for a later run's warm start), but usually a forgotten speculative."""
    for mode in ("off", "suffix"):
        config = RunConfig(drafter=DrafterConfig(enabled=True), generator=GeneratorConfig(speculative=mode))
        [warning] = config.warnings()
        assert f"drafter.enabled = true with generator.speculative = {mode!r}" in warning
        assert "no generator drafts with them" in warning and "'auto'" in warning
    for config in (RunConfig(), RunConfig(drafter=DrafterConfig(enabled=True), generator=GeneratorConfig(
            speculative="auto")), RunConfig(drafter=DrafterConfig(enabled=True), trainer=TrainerConfig(mode="sync"))):
        assert config.warnings() == []


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{path}: config file not found$"):
        load_config(path)


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "steps = 3\n[trainer]\ngroup_size 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: invalid TOML")
    assert "line 3" in str(info.value)


# (file text, overrides, substrings the message must contain)
FILE_ERRORS = [
    ("[trainer]\ngroup_sise = 8\n", [], ["unknown key trainer.group_sise", "did you mean trainer.group_size?"]),
    ("[trainr]\ngroup_size = 8\n", [], ["unknown key trainr", "did you mean trainer?"]),
    ("[trainer]\nseed = 1\n", [], ["unknown key trainer.seed", "did you mean seed or generator.engine.seed"]),
    ("[network]\nxyz = 1\n", [], ["unknown key network.xyz", "keys in [network]: host, trainer_port"]),
    ('[trainer]\ngroup_size = "four"\n', [], ["trainer.group_size: expected `int`, got `str`"]),
    ("[generator.sampling]\nstop_token_ids = [1, \"a\"]\n", [],
     ["generator.sampling.stop_token_ids[1]: expected `int`, got `str`"]),
    ("trainer = 3\n", [], ["trainer: expected a table, got `int`"]),
    ('[trainer]\nloss = "sft"\n', [], ["trainer.loss='sft', expected one of 'ppo', 'tis'"]),
    ("[trainer]\ngroup_size = 1\n", [], ["trainer.group_size=1, expected an integer in [2, 65536]"]),
    ("[trainer]\nlearning_rate = nan\n", [], ["trainer.learning_rate=nan, expected a positive finite number"]),
    ("[generator.engine]\npage_size = 3\n", [], ["generator.engine.page_size=3, expected a power of two in [1, 4096]"]),
    ("[generator.sampling]\ntop_p = 0\n", [], ["generator.sampling.top_p=0.0, expected a number in (0, 1]"]),
    ("[generator.sampling]\nseed = 3\n", [], ["generator.sampling.seed=3, expected unset"]),
    ('[generator]\nspeculative = "eagle"\n', [], ["generator.speculative='eagle', expected", "drafter.enabled"]),
    ('[network]\nhost = "0.0.0.0"\n', [], ["network.host='0.0.0.0', expected a loopback address",
                                          "unless security = 'curve' (or allow_insecure = true"]),
    ('[network]\nsecurity = "tls"\n', [], ["network.security='tls', expected one of", "'curve'"]),
    ('[network]\nhost = "999.1.1.1"\nsecurity = "curve"\n', [], ["network.host='999.1.1.1', expected a valid IP"]),
    ("[network]\nwindow = 2000\n", [], ["network.window=2000, expected an integer in [2, hwm = 1000)"]),
    ("[network]\nheartbeat_timeout_s = 0.5\n", [],
     ["network.heartbeat_timeout_s=0.5, expected more than generator.heartbeat_s = 1.0"]),
    ("[network]\nreconnect_timeout_s = 5.0\n", [],
     ["network.reconnect_timeout_s=5.0, expected a number of seconds in [heartbeat_timeout_s = 10.0, 604800]"]),
    ('[network]\npeer_endpoint = "127.0.0.1:5555"\ntrainer_port = 5000\n', [],
     ["network.peer_endpoint='127.0.0.1:5555', expected tcp://HOST:PORT"]),
    ('[network]\npeer_endpoint = "tcp://no such host:5555"\ntrainer_port = 5000\n', [],
     ["network.peer_endpoint='tcp://no such host:5555', expected tcp://HOST:PORT"]),
    ('[network]\npeer_endpoint = "tcp://127.0.0.1:5555"\n', [],
     ["network.trainer_port=0, expected a fixed port with peer_endpoint = 'tcp://127.0.0.1:5555'"]),
    ("[launch]\nmax_restarts = -1\n", [], ["launch.max_restarts=-1, expected an integer in [0, 1000]"]),
    ("[launch]\nrestart_window_s = 0\n", [],
     ["launch.restart_window_s=0.0, expected a number of seconds in (0, 604800]"]),
    ("[launch]\nrestart_backoff_s = 5\nrestart_backoff_max_s = 2\n", [],
     ["launch.restart_backoff_max_s=2.0, expected at least restart_backoff_s = 5.0"]),
    ("steps = 0\n", [], ["steps=0, expected an integer in [1, 10000000]"]),
    ("[drafter]\nwindow_tokens = 1\n", [], ["drafter.window_tokens=1, expected an integer >= ttt_steps + 2 = 5"]),
    ("[drafter]\nwindow_tokens = 6\n", ["drafter.ttt_steps=5"],
     ["drafter.window_tokens=6, expected an integer >= ttt_steps + 2 = 7 (ttt_steps=5"]),
    ("[drafter]\nacceptance_floor = 5.5\n", [],
     ["drafter.acceptance_floor=5.5, expected at most generator.engine.num_draft_tokens + 1 = 5"]),
    ("[drafter]\nacceptance_floor = 3.5\n", ["generator.engine.num_draft_tokens=2"],
     ["drafter.acceptance_floor=3.5, expected at most generator.engine.num_draft_tokens + 1 = 3"]),
    ("[generator.engine]\nnum_draft_tokens = 9999\n", [],
     ["generator.engine.num_draft_tokens=9999, expected an integer from 1 to 32"]),
    ('[generator.engine]\ndraft_trees = ["1x8:9"]\n', [],
     ["tree shape nodes=9 exceeds the 8 nodes depth=1, width=8 can grow"]),
]


@pytest.mark.parametrize(("text", "overrides", "expected"), FILE_ERRORS, ids=[e[2][0][:40] for e in FILE_ERRORS])
def test_bad_values_in_a_file_name_file_and_key(tmp_path: Path, text: str, overrides: list[str],
                                                expected: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for part in expected:
        assert part in message, message


# (overrides, substrings the message must contain)
OVERRIDE_ERRORS = [
    (["steps"], ["--set 'steps': expected KEY=VALUE"]),
    (["=3"], ["--set '=3': empty key"]),
    (["trainer..group_size=3"], ["key 'trainer..group_size' has an empty part"]),
    (["steps="], ["--set 'steps=': empty value"]),
    (["trainer.group_size=[1, 2"], ["--set 'trainer.group_size=[1, 2': invalid TOML value"]),
    (["trainer.group_size.x=1"], ["trainer.group_size is an integer, not a table"]),
    (["task.prompts.x=1"], ["task.prompts is a string, not a table"]),
    (["trainer.group_size=0"], ["(from --set 'trainer.group_size=0')", "trainer.group_size=0, expected"]),
    (["trainer.lr=1e-5"], ["(from --set 'trainer.lr=1e-5')", "unknown key trainer.lr", "learning_rate"]),
    (["model.name=2024"], ["model.name: expected `str`, got `int`", "quote a string: --set 'model.name=\"2024\"'"]),
    (["generator.engine.draft_trees=2x4:6"], ["(from --set 'generator.engine.draft_trees=2x4:6')",
                                              "expected `array`, got `str`",
                                              "--set 'generator.engine.draft_trees=[\"2x4:6\"]'"]),
    (["generator.engine.model=other.gguf"], ["generator.engine.model='other.gguf', expected unset or equal"]),
    # thread counts libgomp cannot create (100,000 killed the trainer with SIGSEGV at its first step)
    (["trainer.train_threads=100000"], ["trainer.train_threads=100000, expected an integer in [1, 1024]"]),
    (["trainer.borrow_threads=1025"], ["trainer.borrow_threads=1025, expected an integer in [0, 1024]"]),
    (["generator.engine.num_threads=5000"], ["generator.engine.num_threads=5000, expected an integer in [1, 1024]"]),
    (["drafter.num_threads=4096"], ["drafter.num_threads=4096, expected an integer in [1, 1024]"]),
    (['trainer.precision="fp16"'], ["trainer.precision='fp16', expected one of 'auto', 'bf16', 'fp32'"]),
    (["trainer.head_chunk=-1"], ["trainer.head_chunk=-1, expected an integer in [0, 1048576]"]),
]


@pytest.mark.parametrize(("overrides", "expected"), OVERRIDE_ERRORS, ids=[e[1][0][:40] for e in OVERRIDE_ERRORS])
def test_bad_overrides_name_the_override(tmp_path: Path, overrides: list[str], expected: list[str]) -> None:
    path = _write(tmp_path, "steps = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message.startswith(f"{path}"), message
    for part in expected:
        assert part in message, message


def test_override_into_a_scalar_from_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[task]\nprompts = \"a.jsonl\"\n")
    with pytest.raises(ConfigError, match=r"--set 'task.prompts.x=1': task.prompts is a string, not a table"):
        load_config(path, ["task.prompts.x=1"])


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_config(None, ["nonsense"])


def test_structs_built_in_code_are_validated_like_files() -> None:
    with pytest.raises(ValueError, match=r"^staleness_policy='keep', expected one of 'mask', 'drop'$"):
        TrainerConfig(staleness_policy="keep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_groups_in_flight=2, expected an integer in \[batch_groups = 4, "):
        TrainerConfig(max_groups_in_flight=2)
    with pytest.raises(msgspec.ValidationError):  # frozen + strict also when converting
        msgspec.convert({"trainer": {"nope": 1}}, RunConfig)


# ---- atomic write -----------------------------------------------------------------------------


def test_write_resolved_leaves_nothing_behind_when_the_rename_fails(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"

    def failing_replace(src: str, dst: str) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_resolved(RunConfig(), run_dir)
    assert list(run_dir.iterdir()) == []  # neither config.toml nor a stray temporary file


def test_write_resolved_keeps_the_old_file_when_a_rewrite_fails(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_config(None, ["steps=5"])
    path = write_resolved(first, tmp_path)
    before = path.read_text()

    def failing_fsync(fd: int) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        write_resolved(load_config(None, ["steps=6"]), tmp_path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]

