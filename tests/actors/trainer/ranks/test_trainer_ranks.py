"""The sharded trainer (``trainer.world_size`` > 1): FSDP2 over gloo ranks that are real processes on
loopback TCP, against the one-rank trainer on the same work.

* a 2-rank step equals a 1-rank step (loss, updated weights, AdamW state) on the same batch, with
  uneven shares and a rank out of rows for a micro-batch; checkpoints written by either resume in
  the other (the ranks run by ``benchmarks/bench_trainer_ranks.py``'s worker, as the benchmark does);
* ``specroll launch`` with 2 trainer ranks and 2 generators trains 3 steps to the weights of the
  1-rank run, and leaves no process; a killed rank restarts the whole trainer, counted once;
* ``torchrun`` starts the ranks from its environment; bad rank settings exit 2 with the way out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from bench_trainer_ranks import max_weight_diff, run_arm
from helpers.launch import assert_nothing_left, children_of, finish, launch, started_pids, wait_for, write_config
from helpers.timeouts import guard
from safetensors.torch import load_file

from specroll.actors.config import load_config
from specroll.actors.launch.cpu_budget import budget_line, with_cpu_budget
from specroll.actors.launch.rank_roles import free_master, is_trainer_rank, rank_role, with_master
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.cli import main as trainer_main
from specroll.actors.trainer.ranks.join import RankError, resolve_ranks
from specroll.actors.trainer.setup import load_setup
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM, fuse_weights, unfuse_weights
from specroll.protocol.trainer_ranks import BatchShape, Restore, TrainStep, decode_command, encode_command

TOLERANCE = 1e-5
LAUNCHED_WEIGHT_TOLERANCE = 2e-4
"""Two launched runs sample the same tokens, but their behavior logprobs differ at ~1e-6: how the
requests were batched at each engine step depends on timing (a uniform decode step and a mixed one
run different attention kernels), so the TIS ratios differ by as much, and Adam's normalised update
turns that noise on a parameter whose gradient is ~0 into a move of up to ~lr (1e-3) — 6e-5 seen on
a loaded machine. Exact 2-rank = 1-rank training on identical batches is checked to TOLERANCE in
``test_two_ranks_train_like_one_and_checkpoints_resume_across_rank_counts``."""


# ---- ranks from flags and environment, commands, names ---------------------------------------


def test_ranks_come_from_the_flags_over_torchrun_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
    from_env = resolve_ranks(None, None, None, None, env, configured=2)
    assert from_env is not None and (from_env.rank, from_env.world_size, from_env.local_rank) == (1, 2, 1)
    assert from_env.init_method == "tcp://10.0.0.1:29500"
    flags = resolve_ranks(0, 2, "127.0.0.1:4000", None, env, configured=2)  # the flags win
    assert flags is not None and (flags.rank, flags.master_port, flags.local_rank) == (0, 4000, 0)
    assert resolve_ranks(None, None, None, None, {}, configured=1) is None  # one rank: no process group
    assert resolve_ranks(0, 1, "127.0.0.1:4000", None, {}, configured=1) is None
    v6 = resolve_ranks(1, 2, "[::1]:4000", None, {}, configured=2)
    assert v6 is not None and v6.init_method == "tcp://[::1]:4000"


@pytest.mark.parametrize(("flags", "env", "configured", "message"), [
    ((None, None, None), {}, 2, "torchrun --nproc-per-node N -m specroll.actors.trainer"),
    ((0, None, "h:1"), {}, 2, "--world-size missing"),
    ((0, 3, "h:1"), {}, 2, "trainer.world_size = 2 in the config, but 3 ranks were started"),
    ((2, 2, "h:1"), {}, 2, "rank 2 of world size 2"),
    ((0, 2, "h"), {}, 2, "--master 'h', expected ADDR:PORT"),
    ((None, None, None), {"RANK": "0", "WORLD_SIZE": "2"}, 2, "MASTER_ADDR, MASTER_PORT unset"),
    ((None, None, None), {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, 2,
     "but 4 ranks were started (torchrun's environment)"),
])
def test_bad_ranks_are_refused_naming_the_value(flags, env, configured: int, message: str) -> None:
    with pytest.raises(RankError) as err:
        resolve_ranks(*flags, None, env, configured=configured)
    assert message in str(err.value), str(err.value)


def test_the_trainer_exits_2_on_bad_ranks_before_loading_anything(tmp_path: Path, caplog) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\nmodel.name = "{tmp_path / "no-model"}"\n'
                      '[trainer]\nworld_size = 2\nbatch_groups = 2\n')
    assert trainer_main(["--config", str(config)]) == 2
    assert "but no rank was given; start the ranks with `specroll launch CONFIG` or `torchrun" in caplog.text
    assert trainer_main(["--config", str(config), "--rank", "0", "--world-size", "3", "--master", "h:1"]) == 2
    assert "but 3 ranks were started" in caplog.text
    assert trainer_main(["--config", str(config), "--set", "trainer.world_size=3"]) == 2  # more ranks than groups
    assert "trainer.world_size=3, expected an integer in [1, batch_groups = 2]" in caplog.text
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_specroll_trainer_takes_the_rank_flags(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\nmodel.name = "{tmp_path / "no-model"}"\n'
                      '[trainer]\nworld_size = 2\nbatch_groups = 2\n')
    proc = subprocess.run([sys.executable, "-m", "specroll.actors.cli", "trainer", "--config", str(config), "--rank",
                           "0", "--world-size", "3", "--master", "h:1"], capture_output=True, text=True,
                          timeout=guard(120))
    assert proc.returncode == 2, proc.stderr
    assert "but 3 ranks were started" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_commands_round_trip_and_rank_roles() -> None:
    step = TrainStep(version=3, shape=BatchShape(rows=2, tokens=9, continuations=8, response_tokens=5), threads=1)
    assert decode_command(encode_command(step)) == step
    assert decode_command(encode_command(Restore(step=2, with_optimizer=True))) == Restore(step=2, with_optimizer=True)
    bad = msgspec.msgpack.encode({"type": "train_step", "version": "3", "threads": 1,
                                  "shape": {"groups": 2, "tokens": 9, "group_size": 4, "response_tokens": 5}})
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at `\$.version`"):
        decode_command(bad)
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'shutdown'"):
        decode_command(msgspec.msgpack.encode({"type": "shutdown"}))
    assert [rank_role(r) for r in range(3)] == ["trainer", "trainer-rank1", "trainer-rank2"]
    assert all(is_trainer_rank(rank_role(r)) for r in range(3)) and not is_trainer_rank("trainer-rankx")
    assert with_master(["m", "--master", "a:1", "--set", "x=1"], "b:2") == ["m", "--master", "b:2", "--set", "x=1"]


def test_the_cpu_budget_divides_the_trainer_threads_among_its_ranks() -> None:
    config = load_config(None, ["trainer.world_size=2", "trainer.batch_groups=2", "generator.count=2"])
    budgeted = with_cpu_budget(config, 8)
    assert (budgeted.trainer.train_threads, budgeted.trainer.borrow_threads) == (2, 2)  # 4 and 4 for two ranks
    assert budgeted.generator.engine.num_threads == 2
    assert "trainer 2 ranks x 2 thread(s) (+2 while" in budget_line(budgeted, 8)
    assert with_cpu_budget(config, 2).trainer.train_threads == 1  # never below one per rank


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_and_hugging_face_names_round_trip(tiny_checkpoint, arch: str) -> None:
    ckpt = load_checkpoint(tiny_checkpoint(arch))
    model = CausalLM(ckpt.config)
    params = {name: p.detach() for name, p in model.named_parameters()}
    fused = fuse_weights(ckpt.config, unfuse_weights(ckpt.config, params))
    assert fused.keys() == params.keys() and all(torch.equal(fused[k], params[k]) for k in params)
    assert unfuse_weights(ckpt.config, params).keys() == model.hf_weights().keys()


# ---- one step on 2 ranks against 1, and checkpoints across rank counts ----------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _assert_close_checkpoints(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = _tensors(a / name), _tensors(b / name)
        assert ta.keys() == tb.keys(), name
        for key in ta:
            assert ta[key].shape == tb[key].shape and ta[key].dtype == tb[key].dtype, key
            assert float((ta[key] - tb[key]).abs().max()) <= TOLERANCE, (name, key)
    state_a, state_b = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert state_a == state_b


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_train_like_one_and_checkpoints_resume_across_rank_counts(tmp_path: Path) -> None:
    from bench_trainer_ranks import write_model

    model = write_model(tmp_path / "model")
    # 3 groups in 2 micro-batches: 1 rank trains rows {0, 1} then {2}; of 2 ranks, rank 0 has
    # {0}, {1} and rank 1 has {2} and then a pass with nothing to train (FSDP needs it)
    work = dict(steps=2, groups=3, group_size=4, grad_accum_steps=2, timeout_s=guard(240))
    one = run_arm(model, tmp_path / "one", 1, threads=1, **work)
    two = run_arm(model, tmp_path / "two", 2, threads=2, **work)
    assert one["losses"] == pytest.approx(two["losses"], abs=TOLERANCE)
    assert one["grad_norms"] == pytest.approx(two["grad_norms"], rel=1e-5)
    assert min(abs(loss) for loss in one["losses"]) > 1e-3  # a real update: every group has advantages
    assert max_weight_diff(tmp_path / "one", tmp_path / "two") <= TOLERANCE
    initial = load_checkpoint(model).weights
    moved = max(float((_tensors(tmp_path / "one" / "weights.safetensors")[k] - t).abs().max())
                for k, t in initial.items())
    assert moved > 100 * TOLERANCE  # the comparison above is not between two untouched models
    for step in (1, 2):  # the same files, whichever number of ranks wrote them
        _assert_close_checkpoints(tmp_path / "one" / f"checkpoint-{step}", tmp_path / "two" / f"checkpoint-{step}")

    # step 1 on one rank count, step 2 on the other: the straight runs' step 2
    for first, second, world in (("one", "one-then-two", 2), ("two", "two-then-one", 1)):
        resumed = run_arm(model, tmp_path / second, world, threads=2, resume=tmp_path / first / "checkpoint-1",
                          **{**work, "steps": 1})
        assert resumed["losses"] == pytest.approx(one["losses"][1:], abs=TOLERANCE), second
        assert max_weight_diff(tmp_path / second, tmp_path / "one") <= TOLERANCE, second
        _assert_close_checkpoints(tmp_path / second / "checkpoint", tmp_path / "one" / "checkpoint-2")


# ---- real processes: torchrun, specroll launch ---------------------------------------------


def _launch_config(tmp_path: Path, model: Path, name: str, world_size: int, steps: int) -> Path:
    """A sync run (every step's rollouts finished and sampled by the weights just published, so
    both rank counts see the same rollouts) whose prompts all have the answer the tiny model most
    often ends on ("5"): most groups get a reward and a nonzero loss."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"How many clips did Natalia sell in case {i}?",
                                           "answer": "5"}) + "\n" for i in range(32)))
    run = tmp_path / name
    run.mkdir()
    config = write_config(run, model, steps=steps, count=2)
    text = config.read_text().replace("[trainer]\n", f"[trainer]\nworld_size = {world_size}\nmode = \"sync\"\n"
                                      "checkpoint_every = 1\nlearning_rate = 1e-3\n", 1)
    text = text.replace("batch_groups = 1", "batch_groups = 2").replace("group_size = 2", "group_size = 4")
    text = text.replace("max_tokens = 8", "max_tokens = 16")
    config.write_text(text + f'\n[task]\nprompts = "{prompts}"\n\n[launch]\nrestart_backoff_s = 0.2\n')
    return config


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.slow
def test_a_launched_two_rank_trainer_trains_to_the_one_rank_weights(tmp_path: Path, tiny_checkpoint) -> None:
    model = tiny_checkpoint()
    before = children_of(os.getpid())
    runs = {}
    for world in (2, 1):
        config = _launch_config(tmp_path, model, f"ranks{world}", world, steps=3)
        code, _, err = finish(launch(tmp_path, config))
        run_dir = config.parent / "run"
        assert code == 0, err
        assert_nothing_left(run_dir, before)
        runs[world] = run_dir
    assert set(started_pids(runs[2])) == {"trainer", "trainer-rank1", "generator-0", "generator-1"}
    assert "trainer rank 1: stopped by rank 0 after 3 steps" in (runs[2] / "logs" / "trainer-rank1.log").read_text()
    batches = {w: [e["positions"] for e in map(json.loads, (runs[w] / "timeline.jsonl").read_text().splitlines())
                   if e["event"] == "step_groups"] for w in runs}
    assert batches[2] == batches[1] == [[0, 1], [2, 3], [4, 5]]  # the same prompts, in the same rows
    two, one = _metrics(runs[2]), _metrics(runs[1])
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    for a, b in zip(two, one, strict=True):  # the same rollouts (rewards, tokens) and the same loss
        assert (a["reward_mean"], a["trained_tokens"]) == (b["reward_mean"], b["trained_tokens"])
        assert a["loss"] == pytest.approx(b["loss"], abs=TOLERANCE)
    assert sum(abs(m["loss"]) > 1e-3 for m in one) >= 2  # most steps trained on a reward signal
    weights = {w: _tensors(runs[w] / "checkpoint" / "model.safetensors") for w in runs}
    assert max(float((weights[2][k] - weights[1][k]).abs().max()) for k in weights[1]) <= LAUNCHED_WEIGHT_TOLERANCE
    initial = load_checkpoint(model).weights
    assert max(float((weights[1][k] - t).abs().max()) for k, t in initial.items()) > 100 * TOLERANCE


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_rank_restarts_every_rank_from_the_checkpoint_once(tmp_path: Path, tiny_checkpoint) -> None:
    config = _launch_config(tmp_path, tiny_checkpoint(), "killed", 2, steps=5)
    run_dir = config.parent / "run"
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(_metrics(run_dir)) >= 2, "step 2", proc)
    first = started_pids(run_dir)
    os.kill(first["trainer-rank1"], signal.SIGKILL)
    code, _, err = finish(proc)
    assert code == 0, err
    # whichever the launcher saw first — the killed rank, or rank 0 failing on the lost connection —
    # the other is stopped or reported with it, and the unit restarts once
    assert f"trainer-rank1 (pid {first['trainer-rank1']}) was killed by SIGKILL" in err, err
    assert err.count("restart 1 of trainer in ") == 1 and "restart 2" not in err, err
    assert "from its last checkpoint, all 2 ranks" in err
    assert json.loads((run_dir / "restarts.json").read_text())["restarts_by_role"] == {"trainer": 1}
    again = started_pids(run_dir)
    assert again["trainer"] != first["trainer"] and again["trainer-rank1"] != first["trainer-rank1"]
    assert again["generator-0"] == first["generator-0"]  # the generators kept running
    assert [m["step"] for m in _metrics(run_dir)][-1] == 5
    assert "resuming from" in (run_dir / "logs" / "trainer.log").read_text()
    assert_nothing_left(run_dir, before)


@pytest.mark.integration
@pytest.mark.slow
def test_torchrun_starts_the_ranks_from_its_environment(tmp_path: Path, tiny_checkpoint) -> None:
    """Rank 0 restores a checkpoint written by one rank into both ranks' shards, finds the run done
    (its step is ``steps``) and stops rank 1: both exit 0, and torchrun with them."""
    config_path = _launch_config(tmp_path, tiny_checkpoint(), "torchrun", 2, steps=2)
    one_rank = load_config(str(config_path), ["trainer.world_size=1"])
    setup = load_setup(one_rank)
    setup.policy.save(Path(one_rank.run_dir), TrainerState(step=2, policy_version=2, prompt_cursor=4,
                                                           seed=one_rank.seed))
    torchrun = Path(sys.executable).parent / "torchrun"
    port = free_master().rpartition(":")[2]
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", port, "-m", "specroll.actors.trainer",
           "--config", str(config_path)]
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=guard(180))
    finally:
        if proc.poll() is None:  # a hang: torchrun stops its workers (in sessions of their own) on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=guard(30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = (tmp_path / "torchrun.log").read_text()
    assert code == 0, text
    assert "trainer rank 0 of 2 (torchrun's environment)" in text
    assert "the checkpoint is already at step 2 of 2: nothing to train" in text
    assert "trainer rank 1: restored the checkpoint of step 2" in text
    assert "trainer rank 1: stopped by rank 0 after 0 steps" in text


@pytest.mark.integration
def test_rank_0_waiting_for_the_other_ranks_stops_at_sigterm(tmp_path: Path) -> None:
    """Rank 0 meets the other ranks before anything else, with the default signal dispositions: a
    launcher stopping a run whose ranks never all came up does not wait out the rendezvous timeout."""
    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[trainer]\nworld_size = 2\nbatch_groups = 2\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "rank0.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specroll.actors.trainer", "--config", str(config), "--rank",
                                 "0", "--world-size", "2", "--master", f"127.0.0.1:{port}"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # a hang guard for the interpreter's start
        while "waiting for the other ranks" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=guard(120)) == -signal.SIGTERM, log.read_text()  # the rendezvous waits 30 min
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "run").exists()
