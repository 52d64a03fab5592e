"""Which GPUs each role ``specroll launch`` starts on this host may see (``[launch] gpu_per_role``).

On a multi-GPU node every CUDA role gets devices of its own, in this order: the trainer's ranks
GPUs ``0 .. world_size - 1`` (``trainer.device = "cuda"``: rank r uses ``cuda:LOCAL_RANK``, so the
ranks see every GPU), then one GPU per generator whose engine device is ``cuda``, then the drafter
trainer's when its device is ``cuda``. A generator or drafter trainer is pinned with
``CUDA_VISIBLE_DEVICES`` (its ``cuda`` is then that GPU), the way torchrun-style launchers and vLLM
pin workers; a device with an explicit index (``cuda:3``) is the user's choice and left alone, as
is every role on the CPU. Under Ray (``[cluster] backend = "ray"``) Ray assigns GPUs by each role's
``num_gpus`` instead.
"""

from __future__ import annotations

from specroll.actors.config import RunConfig

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def gpu_env(config: RunConfig, drafter_role: str) -> dict[str, dict[str, str]]:
    """Role name → the environment it is started with (``{"CUDA_VISIBLE_DEVICES": "4"}``); roles
    not named keep the launcher's environment. Empty when ``launch.gpu_per_role`` is false."""
    if not config.launch.gpu_per_role:
        return {}
    next_gpu = config.trainer.world_size if config.trainer.device == "cuda" else 0
    plan: dict[str, dict[str, str]] = {}
    if config.generator.engine.device == "cuda":
        for i in range(config.generator.count):
            plan[f"generator-{i}"] = {VISIBLE_DEVICES: str(next_gpu)}
            next_gpu += 1
    if config.runs_drafter_trainer() and config.drafter.device == "cuda":
        plan[drafter_role] = {VISIBLE_DEVICES: str(next_gpu)}
    return plan
