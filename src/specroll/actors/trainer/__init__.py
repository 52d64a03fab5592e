"""The built-in GRPO trainer, one user of the rollout hub (``actors/rollout``), and its ranks. Run as
``python -m specroll.actors.trainer`` or ``specroll trainer``."""
