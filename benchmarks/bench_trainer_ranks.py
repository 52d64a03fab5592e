"""A 2-rank trainer step against a 1-rank step on the same global batch: the sharded trainer
(FSDP2 over gloo, ``actors/trainer/ranks/sharded.py``) must compute the same step, and this measures what
the sharding costs or saves on this machine.

Each arm runs as real trainer processes — rank 0 drives the policy the way the trainer does
(``load_setup`` → ``policy.train``), ranks > 0 run the follower loop (``follower.py``), talking over
loopback TCP — on the same random fp32 Llama and the same GRPO batches (random tokens, random 0/1
rewards, every token sampled by the trained version). It prints each step's loss in the arms and
the largest |Δweight| after it, and their median step times and ratios::

    python benchmarks/bench_trainer_ranks.py                        # 64-wide, 2 layers, 8 groups of 8
    python benchmarks/bench_trainer_ranks.py --hidden 256 --layers 4 --steps 6 --json ranks.json

Arms: A, one rank, the whole batch in one forward/backward, ``--threads`` threads; B, two ranks,
half the groups each, ``--threads / 2`` threads each (the same total); C, one rank running B's two
halves one after the other (``grad_accum_steps = 2``) on ``--threads / 2`` threads. A−B is float
summation order (and thread blocking) amplified by AdamW where a gradient is far below its ε; C−B
isolates what sharding itself adds. On a machine with other work running, threads beyond the free
cores slow every torch operator down (its OpenMP threads wait for each other): the load average is
printed with the figures.
``tests/actors/trainer/ranks/test_trainer_ranks.py`` runs the same worker (:func:`run_arm`) for its equality checks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
WEIGHTS_FILE = "weights.safetensors"
RESULT_FILE = "result.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--groups", type=int, default=8, help="G: groups per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="n: samples per group (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--response-tokens", type=int, default=32, help="longest response (lengths vary below it)")
    p.add_argument("--steps", type=int, default=4, help="steps per arm (default 4; the first is warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all (default 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--worker", nargs=argparse.REMAINDER, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_model(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random-weight Llama (tied embeddings, the tiny tokenizer) of ``hidden`` × ``layers`` at ``path``."""
    import torch
    from safetensors.torch import save_file
    from tiny_model import TINY_VOCAB, write_tiny_tokenizer

    from specroll.engine.model_config import ModelConfig, expected_weight_shapes

    path.mkdir(parents=True, exist_ok=True)
    heads = max(hidden // 16, 2)
    config = ModelConfig(architecture="llama", vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=heads, num_kv_heads=heads // 2, head_dim=hidden // heads,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_ids=(2,))
    gen = torch.Generator().manual_seed(seed)
    save_file({name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.2
               for name, shape in expected_weight_shapes(config).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": hidden, "intermediate_size": config.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    write_tiny_tokenizer(path)
    return path


def step_batch(step: int, groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int):
    """The GRPO batch of step ``step`` (1, 2, ...): random groups, random 0/1 rewards with both values
    in every group (so every group has advantages), every token sampled by version ``step - 1``."""
    import torch

    from specroll.protocol.sampling import SamplingParams
    from specroll.rl.coordinator import Group, Sample
    from specroll.rl.grpo_step import build_batch

    gen = torch.Generator().manual_seed(1000 + step)
    version = step - 1
    batch_groups = []
    for g in range(groups):
        length = int(torch.randint(prompt_tokens // 2, prompt_tokens + 1, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        samples = []
        for _ in range(group_size):
            r = int(torch.randint(1, response_tokens + 1, (1,), generator=gen))
            ids = torch.randint(3, vocab, (r,), generator=gen).tolist()
            logprobs = (-torch.rand(r, generator=gen) * 3 - 2).tolist()  # behavior logprobs around log(1/vocab)
            samples.append(Sample(ids, logprobs, [version] * r, "stop"))
        batch_groups.append(Group(f"s{step}-g{g}", prompt, samples, SamplingParams()))
    rewards = (torch.rand(groups, group_size, generator=gen) < 0.5).float()  # [G, n]
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # both rewards in every group: nonzero advantages
    return build_batch(batch_groups, rewards, normalize_std=True, fill_version=version)


def run_arm(model: Path, out: Path, world_size: int, *, steps: int, groups: int, group_size: int, threads: int,
            prompt_tokens: int = 40, response_tokens: int = 32, lr: float = 1e-3, grad_accum_steps: int = 1,
            resume: Path | None = None, timeout_s: float = 300.0) -> dict:
    """Train ``steps`` steps with ``world_size`` trainer processes (this machine, loopback) into run
    directory ``out``, starting from the checkpoint directory ``resume`` if given; returns rank 0's
    result (its ``losses``, ``step_s``, ``grad_norms``) and leaves in ``out``: the final full weights
    (``weights.safetensors``), ``checkpoint/`` after the last step and ``checkpoint-<step>/`` after each.

    Raises:
        RuntimeError: a rank exited non-zero (its log, ``out/rank<r>.log``, is in the message).
    """
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    if resume is not None:
        shutil.copytree(resume, out / "checkpoint")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = dict(model=str(model), out=str(out), world_size=world_size, steps=steps, groups=groups,
                    group_size=group_size, threads=threads, prompt_tokens=prompt_tokens,
                    response_tokens=response_tokens, lr=lr, grad_accum_steps=grad_accum_steps, port=port)
    procs = []
    for rank in range(world_size):
        with open(out / f"rank{rank}.log", "wb") as log:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({**settings, "rank": rank})]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(codes):
        logs = "\n".join(f"--- rank {r} exited {c}:\n{(out / f'rank{r}.log').read_text()[-3000:]}"
                         for r, c in enumerate(codes) if c)
        raise RuntimeError(f"{world_size}-rank arm failed:\n{logs}")
    return json.loads((out / RESULT_FILE).read_text())


def _worker(settings: dict) -> int:
    """One rank of an arm (run in its own process by :func:`run_arm`)."""
    import logging
    import shutil

    import torch
    from safetensors.torch import save_file

    from specroll.actors.config import load_config
    from specroll.actors.trainer.checkpoint import CHECKPOINT_DIRNAME, TrainerState
    from specroll.actors.trainer.ranks.follower import run_follower
    from specroll.actors.trainer.ranks.join import Ranks
    from specroll.actors.trainer.setup import load_setup

    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out, world, rank = Path(settings["out"]), settings["world_size"], settings["rank"]
    threads = max(1, settings["threads"] // world)
    torch.set_num_threads(threads)
    config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in {
        "run_dir": str(out), "model.name": settings["model"], "trainer.world_size": world,
        "trainer.batch_groups": settings["groups"], "trainer.group_size": settings["group_size"],
        "trainer.max_groups_in_flight": settings["groups"], "trainer.learning_rate": settings["lr"],
        "trainer.weight_decay": 0.01, "trainer.train_threads": threads, "trainer.max_staleness": 0,
        "trainer.grad_accum_steps": settings["grad_accum_steps"],
        "eval.every": 0, "task.builtin_count": 16}.items()])
    ranks = Ranks(rank, world, "127.0.0.1", settings["port"], rank, "bench") if world > 1 else None
    if rank > 0:
        assert ranks is not None
        return run_follower(config, ranks)
    setup = load_setup(config, ranks)
    policy, first = setup.policy, setup.state.step
    losses, times, norms = [], [], []
    try:
        for step in range(first + 1, first + settings["steps"] + 1):
            batch = step_batch(step, settings["groups"], settings["group_size"], settings["prompt_tokens"],
                               settings["response_tokens"], policy.config.vocab_size)
            start = time.perf_counter()
            result = policy.train(batch, step - 1, None)
            times.append(time.perf_counter() - start)
            losses.append(result.loss)
            norms.append(result.grad_norm)
            state = TrainerState(step=step, policy_version=step, prompt_cursor=0, seed=config.seed)
            saved = policy.save(out, state)
            shutil.copytree(saved, out / f"{CHECKPOINT_DIRNAME}-{step}", dirs_exist_ok=True)
        weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in policy.full_weights().items()}
    finally:
        policy.close()
    save_file(weights, str(out / WEIGHTS_FILE))
    (out / RESULT_FILE).write_text(json.dumps({"losses": losses, "step_s": times, "grad_norms": norms,
                                               "threads_per_rank": threads}))
    return 0


def max_weight_diff(a: Path, b: Path, file: str = WEIGHTS_FILE) -> float:
    """Largest |Δ| between the weights ``file`` of two arms' directories (by default the final
    weights; ``checkpoint-<step>/model.safetensors``: after that step)."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / file)), load_file(str(b / file))
    assert wa.keys() == wb.keys(), (sorted(wa), sorted(wb))
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return _worker(json.loads(args.worker[0]))
    sys.path.insert(0, str(BENCH_DIR))
    half_threads = max(1, args.threads // 2)
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        work = Path(tmp)
        model = write_model(work / "model", args.hidden, args.layers)
        work_args = dict(steps=args.steps, groups=args.groups, group_size=args.group_size,
                         prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens, lr=args.lr)
        one = run_arm(model, work / "one", 1, threads=args.threads, **work_args)
        two = run_arm(model, work / "two", 2, threads=args.threads, **work_args)
        # one rank doing what the two ranks do, one after the other: their two micro-batches (summed
        # in the same order) on one rank's share of the threads
        split = run_arm(model, work / "split", 1, threads=half_threads, grad_accum_steps=2, **work_args)

        def diffs(a: str, b: str) -> list[float]:
            return [max_weight_diff(work / a, work / b, f"checkpoint-{step}/model.safetensors")
                    for step in range(1, args.steps + 1)]

        vs_one, vs_split, unsharded = diffs("one", "two"), diffs("split", "two"), diffs("one", "split")
    t1, t2, ts = (statistics.median(arm["step_s"][1:] or arm["step_s"]) for arm in (one, two, split))
    print(f"model: {args.hidden} wide, {args.layers} layers, fp32; batch: {args.groups} groups x {args.group_size} "
          f"samples; {args.steps} steps; {args.threads} torch threads in all; load average {os.getloadavg()[0]:.2f}")
    print("A: 1 rank, the batch in one pass; B: 2 ranks, half the groups each; "
          "C: 1 rank, B's two halves one after the other")
    for i, (la, lb, da, dc, du) in enumerate(zip(one["losses"], two["losses"], vs_one, vs_split, unsharded,
                                                 strict=True), start=1):
        print(f"step {i}: loss A {la:+.8f} B {lb:+.8f} |A-B| {abs(la - lb):.1e}; max |dweight| after it: "
              f"A-B {da:.1e}, C-B {dc:.1e} (A-C, no sharding: {du:.1e})")
    print(f"step time (median after the first): A 1 rank x {one['threads_per_rank']} threads {t1 * 1e3:.1f} ms, "
          f"B 2 ranks x {two['threads_per_rank']} threads {t2 * 1e3:.1f} ms, "
          f"C 1 rank x {split['threads_per_rank']} threads {ts * 1e3:.1f} ms; B/A {t2 / t1:.2f}, B/C {t2 / ts:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
                                         "one_rank": one, "two_ranks": two, "one_rank_split": split,
                                         "max_weight_diff_a_b": vs_one, "max_weight_diff_c_b": vs_split,
                                         "max_weight_diff_a_c": unsharded,
                                         "step_s_ratio_b_a": t2 / t1, "step_s_ratio_b_c": t2 / ts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR))
    sys.exit(main())
