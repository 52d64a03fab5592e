"""The TRL arm of ``bench_e2e.py``: ``trl.GRPOTrainer`` on the CPU, run as a child process.

The parent (:func:`run_trl_arm`) writes the job — every setting taken from the same resolved
:class:`RunConfig` the specroll arms launch with — starts ``python e2e_trl.py JOB.json RESULT.json``
and times it from the moment it starts the child, as the specroll arms are timed from the moment
they start the launcher. The child (:func:`main`):

1. builds the policy as a plain float32 transformers model: the architecture from the checkpoint's
   config (a GGUF's ``quantization_config`` dropped: the Trainer refuses quantized models) and
   specroll's own dequantized weights (``load_checkpoint``), so every arm starts from the same tensors,
   and checks it against specroll's model (same prompt ids, float32 logits within
   :data:`LOGIT_TOLERANCE`) before the Trainer wraps its forward in autocast;
2. trains with GRPOTrainer: ``beta=0``, one update per batch, ``loss_type="dapo"`` (TRL 1.16
   normalises the summed token losses by the active tokens of the whole generation batch, which
   with ``gradient_accumulation_steps=1`` is specroll's ``sum over tokens / trained tokens of the
   step``), group std-normalised advantages (``scale_rewards="group"``), AdamW at a constant LR, no
   gradient checkpointing (TRL's default is on; specroll's trainer keeps its activations), at the
   resolved ``trainer.precision``: ``fp32`` is ``bf16=False`` (train and generate in float32);
   ``bf16`` is ``bf16=True``, which on the CPU is accelerate's ``Accelerator.prepare_model`` wrapping
   the model's ``forward`` in ``torch.autocast("cpu", dtype=torch.bfloat16)`` over the float32
   parameters and AdamW state — the training forward *and* TRL's ``model.generate`` (its unwrapped
   model keeps the wrapped forward: ``unwrap_model(keep_fp32_wrapper=True)``), as specroll's ``bf16``
   autocasts its trainer and the benchmark serves bfloat16 from its generators;
3. evaluates before the first step, every ``eval.every`` steps and after the last by loading the
   model's weights into a specroll :class:`Engine` configured as the specroll arms' generators (their
   dtype included) and calling :func:`~specroll.rl.evaluation.evaluate_engine` — the code the specroll
   trainer runs on its generators, with the same per-prompt seeds — and times those evaluations (and
   step 1's check) separately.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e_results import ArmResult
from e2e_settings import Settings

from specroll.actors.config import RunConfig

LOGIT_TOLERANCE = 1e-3
"""Largest |logit| difference allowed between the transformers model and specroll's on one prompt (float32)."""


def trl_unavailable() -> str | None:
    """Why the TRL arm cannot run here (a missing package, with the install command), or None."""
    missing = [m for m in ("trl", "datasets", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)} (pip install -e '.[bench]')" if missing else None


def trl_job(config: RunConfig, threads: int, output_dir: Path) -> dict[str, Any]:
    """The child's settings, all read from ``config`` (the specroll arms' resolved run config)."""
    import msgspec

    t, s = config.trainer, config.generator.sampling
    engine = msgspec.structs.replace(config.generator.engine, num_threads=threads)
    return {"model": config.model.name, "seed": config.seed, "steps": config.steps, "prompts": t.batch_groups,
            "group": t.group_size, "learning_rate": t.learning_rate, "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm, "normalize_std": t.normalize_std,
            "sampling": msgspec.to_builtins(s), "builtin_count": config.task.builtin_count,
            "digits": config.task.digits, "operators": config.task.operators, "eval_every": config.eval.every,
            "eval_count": config.eval.count, "engine": msgspec.to_builtins(engine), "threads": threads,
            "precision": t.precision, "output_dir": str(output_dir)}


def run_trl_arm(s: Settings, seed: int, config: RunConfig, workdir: Path) -> ArmResult:
    """Run the TRL arm on ``seed`` in a child process; a failure is a ``failed`` result with the log's tail."""
    reason = trl_unavailable()
    if reason is not None:
        return ArmResult("trl", seed, status="skipped", reason=reason)
    workdir.mkdir(parents=True, exist_ok=True)
    job, out, log = workdir / "job.json", workdir / "result.json", workdir / "trl.log"
    job.write_text(json.dumps(trl_job(config, s.trl_threads, workdir / "trainer")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(s.trl_threads)}
    start = time.time()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, __file__, str(job), str(out)], stdout=f, stderr=subprocess.STDOUT,
                                env=env)
    try:
        code = proc.wait(timeout=s.arm_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            proc.kill()  # the child starts no processes of its own (dataloader_num_workers=0)
            proc.wait()
    if code != 0 or not out.exists():
        what = f"timed out after {s.arm_timeout_s:g} s" if code is None else f"exited {code}"
        tail = log.read_text(errors="replace").splitlines()[-15:]
        return ArmResult("trl", seed, status="failed", reason=f"{what}; {log}:\n" + "\n".join(tail))
    return _read_result(json.loads(out.read_text()), seed, start)


def _read_result(r: dict[str, Any], seed: int, start: float) -> ArmResult:
    """The child's result as an :class:`ArmResult`, times relative to ``start`` (the child's start)."""
    steps = r["steps"]
    return ArmResult(
        "trl", seed, rewards=[x["reward"] for x in steps], step_end_s=[x["end"] - start for x in steps],
        train_start_s=r["train_start"] - start, eval_accuracy={e["step"]: e["accuracy"] for e in r["evals"]},
        wall_s=r["end"] - start, eval_s=r["eval_s"], wall_s_without_eval=r["end"] - start - r["eval_s"],
        eval_s_until=[x["eval_s_until"] for x in steps], samples=sum(x["samples"] for x in steps),
        extra={k: r[k] for k in ("evals", "versions", "engine_dtype", "logit_max_diff", "step_time")})


# ---- the child process --------------------------------------------------------------------------------


def hf_policy(name: str) -> tuple[Any, Any, Any]:
    """(float32 transformers model, transformers tokenizer, specroll checkpoint) of ``name``; also what
    ``vllm_serve_arm.py`` saves for ``vllm serve``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.loaders.registry import resolve_model

    ckpt = load_checkpoint(name, dtype=torch.float32)
    path = resolve_model(name)
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} if path.is_file() else {
        "pretrained_model_name_or_path": str(path)}
    hf_config = AutoConfig.from_pretrained(**where)
    if getattr(hf_config, "quantization_config", None) is not None:
        del hf_config.quantization_config  # dequantized weights: train them as plain float32
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{name}: weights do not match the transformers model: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    return model, AutoTokenizer.from_pretrained(**where), ckpt


def _check_parity(model: Any, tokenizer: Any, ckpt: Any, messages: list[dict[str, str]]) -> float:
    """The transformers model and tokenizer against specroll's on one prompt: the same chat-templated
    token ids and logits within :data:`LOGIT_TOLERANCE`. Returns the largest |logit| difference.

    Raises:
        RuntimeError: the token ids differ or the logits are further apart.
    """
    import torch

    from specroll.engine.model import CausalLM

    ids = ckpt.tokenizer.encode_chat(messages)
    theirs = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    if list(theirs) != ids:
        raise RuntimeError(f"the transformers tokenizer's prompt differs from specroll's: {theirs} vs {ids}")
    reference = CausalLM(ckpt.config)
    reference.load_weights(ckpt.weights)
    x = torch.tensor([ids])  # [1, T]
    with torch.no_grad():
        diff = float((model(x).logits.float() - reference.score(x, torch.ones_like(x, dtype=torch.bool))).abs().max())
    if not diff <= LOGIT_TOLERANCE:
        raise RuntimeError(f"transformers and specroll logits differ by {diff} (> {LOGIT_TOLERANCE})")
    return diff


class _Evaluator:
    """The held-out evaluation of the transformers model's current weights on a specroll engine
    configured as the specroll arms' generators (module docstring, step 3); times itself."""

    def __init__(self, job: dict[str, Any], split: Any, sampling: Any, tokenizer: Any, ckpt: Any) -> None:
        self.job, self.split, self.sampling, self.tokenizer, self._ckpt = job, split, sampling, tokenizer, ckpt
        self.engine: Any = None
        self.seconds = 0.0
        """Evaluation seconds so far (with the parity check's; the first includes building the engine)."""
        self.results: list[dict[str, float]] = []
        self.logit_max_diff: float | None = None

    def check(self, policy: Any) -> None:
        """:func:`_check_parity` of ``policy`` (timed as evaluation). Called before the Trainer prepares
        the model: at ``bf16`` its forward is autocast from then on, and the check is of float32 logits."""
        from specroll.rl.tasks import format_question

        start = time.perf_counter()
        question = format_question(self.split.eval[0].question, self.split.instruction)
        self.logit_max_diff = _check_parity(policy, self.tokenizer, self._ckpt, question)
        self._ckpt = None  # its weights are freed: the model holds its own copy
        self.seconds += time.perf_counter() - start

    def __call__(self, policy: Any, step: int) -> None:
        import msgspec

        from specroll.engine.config import EngineConfig
        from specroll.engine.engine import Engine
        from specroll.rl.evaluation import evaluate_engine
        from specroll.rl.tasks import format_question, gsm8k_reward

        start = time.perf_counter()
        if self.engine is None:
            self.engine = Engine(msgspec.convert(self.job["engine"], EngineConfig))
        weights = policy.state_dict()  # HF names; a tied lm_head.weight is not among the engine's
        self.engine.update_weights({n: weights[n].detach() for n in self.engine.model.hf_weights()}, step + 1)
        prompts = [(p, self.engine.tokenizer.encode_chat(format_question(p.question, self.split.instruction)))
                   for p in self.split.eval]
        result = evaluate_engine(self.engine, prompts, self.sampling, gsm8k_reward)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.results.append({"step": step, "accuracy": result.accuracy, "seconds": seconds})
        print(f"evaluation after step {step}: accuracy {result.accuracy:.3f} ({seconds:.1f} s)", flush=True)


def _grpo_config(job: dict[str, Any], sampling: Any) -> Any:
    """GRPOConfig with every setting that matters set explicitly (module docstring, step 2)."""
    import trl

    return trl.GRPOConfig(
        output_dir=job["output_dir"], per_device_train_batch_size=job["prompts"] * job["group"],
        num_generations=job["group"], gradient_accumulation_steps=1, learning_rate=job["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=job["weight_decay"],
        max_grad_norm=job["max_grad_norm"], optim="adamw_torch", beta=0.0, num_iterations=1, loss_type="dapo",
        scale_rewards="group" if job["normalize_std"] else "none", temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, max_completion_length=sampling.max_tokens,
        bf16=job["precision"] == "bf16",  # the CPU's autocast to bfloat16 (module docstring, step 2)
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=job["seed"], max_steps=job["steps"],
        shuffle_dataset=True, disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=False)  # TRL's default recomputes activations; specroll's trainer never does


def _recorder(job: dict[str, Any], evaluate: _Evaluator, steps: dict[int, dict[str, float]],
              started: dict[str, float]) -> Any:
    """A TrainerCallback: evaluation (unless ``eval_every`` is 0) before step 1 and after every
    ``eval_every``-th and the last step;
    per step its end time (``time.time()``), evaluation seconds so far, reward and TRL's step_time."""
    import transformers

    class Recorder(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            started["train_start"] = time.time()
            if job["eval_every"]:  # 0 disables evaluation, as eval.every = 0 does in the specroll arms
                evaluate(model, 0)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            step = state.global_step
            steps[step] = {"step": step, "end": time.time(), "eval_s_until": evaluate.seconds,
                           "samples": job["prompts"] * job["group"]}
            if job["eval_every"] and (step % job["eval_every"] == 0 or step == job["steps"]):
                evaluate(model, step)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **_: Any) -> None:
            if logs and "reward" in logs and state.global_step in steps:
                steps[state.global_step].update(reward=logs["reward"], step_time=logs.get("step_time", 0.0))
                print(f"step {state.global_step}: reward {logs['reward']:.3f}", flush=True)

    return Recorder()


def main(argv: list[str]) -> int:
    """``e2e_trl.py JOB.json RESULT.json``: train, evaluate, write the result (times are ``time.time()``)."""
    job = json.loads(Path(argv[0]).read_text())
    import msgspec
    import torch

    torch.set_num_threads(job["threads"])
    import datasets
    import transformers
    import trl

    from specroll.protocol.sampling import SamplingParams
    from specroll.rl.tasks import builtin_task, format_question, gsm8k_reward

    split = builtin_task(job["builtin_count"], job["seed"], digits=job["digits"], operators=job["operators"],
                         eval_count=job["eval_count"])
    sampling = msgspec.convert(job["sampling"], SamplingParams)
    model, tokenizer, ckpt = hf_policy(job["model"])
    evaluate = _Evaluator(job, split, sampling, tokenizer, ckpt)
    del ckpt
    evaluate.check(model)
    rows = [{"prompt": [{"role": "user", "content": format_question(p.question, split.instruction)[0]["content"]}],
             "answer": p.answer} for p in split.train]

    def reward(completions: list[list[dict[str, str]]], answer: list[str], **_: object) -> list[float]:
        return [gsm8k_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    steps: dict[int, dict[str, float]] = {}
    started: dict[str, float] = {}
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=_grpo_config(job, sampling),
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[_recorder(job, evaluate, steps, started)])
    trainer.train()
    end = time.time()
    ordered = [steps[k] for k in sorted(steps)]
    if [x["step"] for x in ordered] != list(range(1, job["steps"] + 1)) or any("reward" not in x for x in ordered):
        raise RuntimeError(f"expected steps 1..{job['steps']} with a logged reward, got {ordered}")
    dtype = None if evaluate.engine is None else str(evaluate.engine.dtype).removeprefix("torch.")
    result = {"train_start": started["train_start"], "end": end, "eval_s": evaluate.seconds, "steps": ordered,
              "evals": evaluate.results, "engine_dtype": dtype,
              "logit_max_diff": evaluate.logit_max_diff, "step_time": [x["step_time"] for x in ordered],
              "versions": {m.__name__: m.__version__ for m in (torch, transformers, trl, datasets)}}
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
