"""The drafter-trainer role: trains the EAGLE drafter online and publishes drafter versions.
Run as ``python -m specroll.actors.drafter_trainer`` or ``specroll drafter serve``."""
