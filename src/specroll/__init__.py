"""specroll: an asynchronous rollout engine for reinforcement learning on language models.

Layers, each importing only those above it in this list: ``protocol`` (wire messages, codec,
sockets), ``engine`` (the synchronous inference core), ``drafter`` (proposers and drafter training),
``rl`` (pure RL maths: GRPO, tasks and rewards, the rollout coordinator's state machine) and
``actors`` (processes, sockets, the CLI). The embedding API is ``specroll.engine`` and
``specroll.actors``.
"""

__version__ = "0.1.0"
