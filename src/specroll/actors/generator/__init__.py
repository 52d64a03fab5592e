"""The generator role: one engine behind a DEALER socket, streaming rollouts to the trainer.
Run as ``python -m specroll.actors.generator`` or ``specroll generator``."""
