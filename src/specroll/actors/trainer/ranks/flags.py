"""The trainer's rank flags, in a module of their own: ``specroll trainer`` builds its parser from
them before any heavy import (``actors/cli.py``)."""

from __future__ import annotations

import argparse


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    """The rank flags (``python -m specroll.actors.trainer`` and ``specroll trainer`` take them)."""
    ranks = p.add_argument_group("trainer ranks (trainer.world_size > 1; these win over torchrun's RANK, "
                                 "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)")
    ranks.add_argument("--rank", type=int, default=None, help="this process's rank, 0 to N-1 (0 hosts the trainer)")
    ranks.add_argument("--world-size", type=int, default=None, help="N: the trainer's ranks (= trainer.world_size)")
    ranks.add_argument("--master", default=None, metavar="ADDR:PORT",
                       help="where the ranks rendezvous (rank 0 listens there)")
    ranks.add_argument("--local-rank", type=int, default=None,
                       help="its index on this host (its CUDA device); default: --rank")
