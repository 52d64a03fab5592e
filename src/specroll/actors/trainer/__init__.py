"""The trainer side: the rollout client (every generator's and drafter trainer's peer, also the
embedding API) and the built-in GRPO trainer on top of it. Run as ``python -m specroll.actors.trainer``
or ``specroll trainer``."""
