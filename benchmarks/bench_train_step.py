"""Profile of one default GRPO training step, split by phase, for each precision / LM-head / thread setting.

The step is the example run's (``examples/gsm8k_smollm2.toml``): ``trainer.batch_groups`` groups of
``trainer.group_size`` responses to the built-in task's prompts, sampled at T = 1 by the real engine
from the real default model (so the lengths are the first steps' — the longest of a run), packed
and trained in ``trainer.grad_accum_steps`` micro-batches with AdamW. Each arm is a setting of
``trainer.precision`` (fp32 / bf16), ``trainer.head_chunk`` (0: the whole ``[tokens, vocab]`` head at
once; else tokens per chunk) and torch threads; the arms run interleaved (A B C ... A B C ...) on
one model and one optimizer, as the trainer keeps them. Per arm, the median over rounds of:

* ``step_s``: the real ``grpo_step.train_step`` (packing included), and trained tokens/s;
* the phases of an instrumented copy of the same step: ``pack`` (``build_batch``: host work),
  ``forward`` (the decoder), ``head_forward`` and ``head_backward`` (LM head + logprobs),
  ``backward`` (the decoder), ``optimizer`` (clip + AdamW);
* ``step_peak_mb``: the step's peak memory above the RSS before it (VmHWM reset through
  ``/proc/self/clear_refs`` before the real step), and ``peak_rss_mb``, the process's peak then.

Ratios against the first arm (the trainer before this work: fp32, whole head, unfused AdamW, one
thread — its base budget) are printed, with the same comparison at equal threads.

    .venv/bin/python benchmarks/bench_train_step.py --json bench_train_step.json      # ~6 min here
    .venv/bin/python benchmarks/bench_train_step.py --max-tokens 256 --rounds 2     # long responses (GSM8K-like)
    .venv/bin/python benchmarks/bench_train_step.py --quick --model TINY_HF_DIR       # CI smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gsm8k_smollm2.toml"


@dataclass(frozen=True)
class Arm:
    precision: str
    head_chunk: int
    threads: int
    adamw: str = "fused"
    """``fused`` (the trainer's, ``grpo_step.policy_optimizer``) or ``loop`` (torch's default AdamW:
    a loop over the tensors, what the trainer ran before)."""

    @property
    def name(self) -> str:
        head = "whole head" if self.head_chunk == 0 else f"chunk {self.head_chunk}"
        return f"{self.precision}, {head}, {self.threads}t, {self.adamw}"


def parse_arm(text: str) -> Arm:
    """argparse type: ``PRECISION:CHUNK:THREADS[:ADAMW]`` such as ``bf16:512:2`` or ``fp32:0:1:loop``."""
    try:
        precision, chunk, threads, *adamw = text.split(":")
        arm = Arm(precision, int(chunk), int(threads), *adamw)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PRECISION:CHUNK:THREADS[:ADAMW] such as bf16:512:2 "
                                         "or fp32:0:1:loop") from None
    checks = [(arm.precision in ("fp32", "bf16"), f"precision {arm.precision!r} (expected fp32 or bf16)"),
              (0 <= arm.head_chunk <= MAX_CHUNK, f"chunk {arm.head_chunk} (expected 0 to {MAX_CHUNK})"),
              (1 <= arm.threads <= MAX_THREADS, f"threads {arm.threads} (expected 1 to {MAX_THREADS})"),
              (arm.adamw in ("fused", "loop"), f"AdamW {arm.adamw!r} (expected fused or loop)")]
    wrong = [message for ok, message in checks if not ok]
    if wrong:
        raise argparse.ArgumentTypeError(f"{text!r}: " + ", ".join(wrong))
    return arm


MAX_CHUNK = 1 << 20  # trainer.head_chunk's bound
MAX_THREADS = 1024  # engine/config.py's MAX_NUM_THREADS (this script imports no specroll before parsing)
DEFAULT_ARMS = ["fp32:0:1:loop", "fp32:0:1", "fp32:512:1", "bf16:0:1", "bf16:512:1", "fp32:0:2:loop", "bf16:512:2"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=EXAMPLE, help="run config whose [trainer] and sampling are used")
    p.add_argument("--model", help="model instead of the config's (a tiny checkpoint directory for --quick)")
    p.add_argument("--arms", type=parse_arm, nargs="+", default=[parse_arm(a) for a in DEFAULT_ARMS],
                   help="PRECISION:CHUNK:THREADS[:ADAMW] each (fp32|bf16, head chunk 0 = whole, threads, "
                        "fused|loop AdamW, default fused); the first is the baseline "
                        f"(default {' '.join(DEFAULT_ARMS)})")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds over every arm (default 5)")
    p.add_argument("--max-tokens", type=int, help="response tokens at most (default: the config's sampling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 rounds, 16-token responses: a smoke run")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected a positive integer")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens {args.max_tokens}: expected a positive integer")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: its folder {args.json.parent} does not exist")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    if args.quick:
        args.rounds = min(args.rounds, 2)
    return args


def rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS since the last reset) of this process in MB, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak_rss() -> bool:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``: tensors of a few MB, such as
    one layer's gradient, live on the heap and stay resident after they are freed), so the RSS is
    what is live, then reset VmHWM to it (Linux ≥ 4.0: ``echo 5 > /proc/self/clear_refs``). False
    where either is refused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except (OSError, AttributeError):  # no glibc, or no /proc
        return False


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")  # a tiny model's step can stay within the RSS it had


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specroll.actors.config import load_config
    from specroll.actors.trainer.task_load import load_task
    from specroll.engine.config import EngineConfig
    from specroll.engine.driver import run_to_completion
    from specroll.engine.engine import Engine
    from specroll.engine.head_logprobs import head_logprobs
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.model import CausalLM
    from specroll.protocol.sampling import SamplingParams
    from specroll.rl.coordinator import Group, Sample
    from specroll.rl.grpo import apply_staleness, policy_loss
    from specroll.rl.grpo_step import build_batch, policy_optimizer, precision_context, train_step
    from specroll.rl.tasks import format_question

    try:
        config = load_config(args.config)
        tc = config.trainer
        model_name = args.model or config.model.name
        ckpt = load_checkpoint(model_name, torch.float32)
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError: a bad --config or --model
        print(f"error: {e}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens if args.max_tokens is not None else (
        16 if args.quick else config.generator.sampling.max_tokens)

    # The step's rollouts: the real engine (bf16 where the generators run it) samples them at T = 1.
    split = load_task(config)
    prompts = [ckpt.tokenizer.encode_chat(format_question(p.question, split.instruction))
               for p in split.train[: tc.batch_groups]]
    engine = Engine(EngineConfig(model=model_name, dtype="auto", kv_cache_memory_gb=0.25, seed=args.seed,
                                 num_threads=2))
    for g, prompt in enumerate(prompts):
        for i in range(tc.group_size):
            engine.add_request(prompt, SamplingParams(temperature=config.generator.sampling.temperature,
                                                      max_tokens=max_tokens, ignore_eos=args.max_tokens is not None,
                                                      seed=args.seed * 1000 + g * 100 + i),
                               request_id=f"{g}-{i}")
    done = run_to_completion(engine)
    del engine
    groups = [Group(f"g{g}", prompt, [Sample(list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason)
                                      for c in (done[f"{g}-{i}"] for i in range(tc.group_size))], SamplingParams())
              for g, prompt in enumerate(prompts)]
    gen = torch.Generator().manual_seed(args.seed)
    rewards = (torch.rand(len(groups), tc.group_size, generator=gen) < 0.5).float()
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # every group carries a signal
    response_tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
    packed_tokens = sum(len(g.prompt_token_ids) + sum(len(s.token_ids) for s in g.samples) for g in groups)

    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    del ckpt
    fused = policy_optimizer(model.parameters(), tc.learning_rate, tc.weight_decay)
    loop = torch.optim.AdamW(model.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    assert not loop.defaults["fused"] and not loop.defaults["foreach"]
    optimizers = {"fused": fused, "loop": loop}  # one AdamW state each (made by the warm-up steps)
    device = torch.device("cpu")

    def settings(arm: Arm):  # what train_step reads: the config's trainer with this arm's settings
        import msgspec

        return msgspec.structs.replace(tc, precision=arm.precision, head_chunk=arm.head_chunk)

    def batch():
        return build_batch(groups, rewards, normalize_std=tc.normalize_std, fill_version=0)

    def phases(arm: Arm) -> dict[str, float]:
        """The step of ``train_step`` (one rank, every token lag 0), timed phase by phase."""
        s, optimizer = settings(arm), optimizers[arm.adamw]
        t: dict[str, float] = dict.fromkeys(("pack", "forward", "head_forward", "head_backward", "backward",
                                             "optimizer"), 0.0)
        start = time.perf_counter()
        b = batch()
        mask, _, _ = apply_staleness(b.loss_mask, b.versions, 0, s.max_staleness, s.staleness_policy)
        total = int(mask.sum())
        t["pack"] = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        for rows in torch.arange(len(groups)).tensor_split(min(s.grad_accum_steps, len(groups))):
            start = time.perf_counter()
            tlen = int(b.row_lengths[rows].max())
            samples, local = b.continuations_of(rows)
            real = b.loss_mask[samples]
            local_row = local[:, None].expand_as(real)
            with precision_context(s.precision, device):
                hidden = model.hidden_dense(b.input_ids[rows, :tlen], b.positions[rows, :tlen],
                                            b.attention_mask(rows, tlen))
            h = hidden[local_row[real], b.predecessor[samples][real]]
            t["forward"] += time.perf_counter() - start
            start = time.perf_counter()
            h_leaf = h.detach().requires_grad_(True)
            with precision_context(s.precision, device):
                lp = head_logprobs(h_leaf, model.lm_head_weight, b.targets[samples][real], s.head_chunk)
            logprobs = torch.zeros(real.shape).masked_scatter(real, lp)
            loss, _ = policy_loss(logprobs, b.behavior_logprobs[samples], b.advantages[samples], mask[samples],
                                  kind=s.loss, tis_cap=s.tis_cap, clip_eps=s.clip_eps, num_tokens=total)
            t["head_forward"] += time.perf_counter() - start
            start = time.perf_counter()
            loss.backward()
            t["head_backward"] += time.perf_counter() - start
            start = time.perf_counter()
            h.backward(h_leaf.grad)
            t["backward"] += time.perf_counter() - start
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), s.max_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t["optimizer"] = time.perf_counter() - start
        return t

    def real_step(arm: Arm) -> dict[str, float]:
        reset = reset_peak_rss()
        before, _ = rss_mb()
        start = time.perf_counter()
        result = train_step(model, optimizers[arm.adamw], batch(), 0, settings(arm))
        elapsed = time.perf_counter() - start
        _, peak = rss_mb()
        assert result.trained_tokens == response_tokens, (result.trained_tokens, response_tokens)
        return {"step_s": elapsed, "step_peak_mb": peak - before if reset else float("nan"), "peak_rss_mb": peak,
                "loss": result.loss, "grad_norm": result.grad_norm}

    print(f"model {model_name}: {len(groups)} groups x {tc.group_size} responses, {response_tokens} response tokens "
          f"({packed_tokens} packed), {tc.grad_accum_steps} micro-batches; load {os.getloadavg()[0]:.2f}", flush=True)
    for arm in args.arms:  # warm-up: AdamW's state, oneDNN's kernels for each shape and dtype
        torch.set_num_threads(arm.threads)
        real_step(arm)
    records: dict[str, list[dict[str, float]]] = {arm.name: [] for arm in args.arms}
    for r in range(args.rounds):
        for arm in args.arms:
            torch.set_num_threads(arm.threads)
            record = real_step(arm)
            record.update(phases(arm))
            records[arm.name].append(record)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{a.name} {records[a.name][-1]['step_s']:.2f} s"
                                                           for a in args.arms), flush=True)

    keys = ["step_s", "pack", "forward", "head_forward", "head_backward", "backward", "optimizer", "step_peak_mb",
            "peak_rss_mb"]
    medians = {name: {k: statistics.median(rec[k] for rec in recs) for k in keys} for name, recs in records.items()}
    base = args.arms[0]
    print(f"\n{'arm':<28}" + "".join(f"{k:>14}" for k in keys) + f"{'tokens/s':>10}{'speed-up':>10}{'memory':>8}")
    for arm in args.arms:
        m = medians[arm.name]
        m["tokens_per_s"] = response_tokens / m["step_s"]
        m["speedup"] = medians[base.name]["step_s"] / m["step_s"]
        m["memory_ratio"] = _ratio(m["step_peak_mb"], medians[base.name]["step_peak_mb"])
        print(f"{arm.name:<28}" + "".join(f"{m[k]:>14.3f}" for k in keys)
              + f"{m['tokens_per_s']:>10.1f}{m['speedup']:>9.2f}x{m['memory_ratio']:>7.2f}x")
    equal = [(a, b) for a in args.arms for b in args.arms
             if a.threads == b.threads and (a.precision, a.head_chunk, a.adamw) == (base.precision, base.head_chunk,
                                                                                  base.adamw) and a != b]
    for a, b in equal:
        print(f"at {a.threads} thread(s): {b.name} is {medians[a.name]['step_s'] / medians[b.name]['step_s']:.2f}x "
              f"{a.name}, step memory {_ratio(medians[b.name]['step_peak_mb'], medians[a.name]['step_peak_mb']):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({
            "model": model_name, "groups": len(groups), "group_size": tc.group_size, "response_tokens": response_tokens,
            "packed_tokens": packed_tokens, "grad_accum_steps": tc.grad_accum_steps, "rounds": args.rounds,
            "arms": [asdict(a) | {"name": a.name} for a in args.arms], "medians": medians, "records": records,
            "load_average": os.getloadavg()[0],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
