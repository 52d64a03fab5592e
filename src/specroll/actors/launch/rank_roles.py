"""How ``specroll launch`` names and starts the ranks of a sharded trainer (``trainer.world_size`` > 1).

Rank 0 is the role ``trainer`` (log ``trainer.log``: it binds the endpoint and talks to the
generators); rank r > 0 is the role ``trainer-rank<r>``. Every rank gets
``--rank R --world-size N --master 127.0.0.1:PORT`` (``actors/trainer/ranks/join.py``), with a fresh free
PORT at each start of the ranks: a restarted unit never meets its dead predecessor's store.
"""

from __future__ import annotations

import socket

TRAINER_ROLE = "trainer"
RANK_ROLE_PREFIX = "trainer-rank"


def rank_role(rank: int) -> str:
    """The role name of trainer rank ``rank``: ``trainer`` for 0, else ``trainer-rank<rank>``."""
    return TRAINER_ROLE if rank == 0 else f"{RANK_ROLE_PREFIX}{rank}"


def is_trainer_rank(role: str) -> bool:
    """Whether ``role`` is one of the trainer's ranks (rank 0 included)."""
    return role == TRAINER_ROLE or (role.startswith(RANK_ROLE_PREFIX) and role[len(RANK_ROLE_PREFIX):].isdigit())


def rank_args(rank: int, world_size: int, master: str) -> list[str]:
    """The trainer command-line flags of rank ``rank``."""
    return ["--rank", str(rank), "--world-size", str(world_size), "--master", master]


def with_master(module_args: list[str], master: str) -> list[str]:
    """``module_args`` with the value of ``--master`` replaced by ``master``.

    Raises:
        ValueError: ``module_args`` has no ``--master`` flag with a value.
    """
    i = module_args.index("--master")
    if i + 1 >= len(module_args):
        raise ValueError(f"--master without a value in {module_args}")
    return [*module_args[: i + 1], master, *module_args[i + 2 :]]


def free_master(host: str = "127.0.0.1") -> str:
    """``HOST:PORT`` with a port free right now (the kernel's pick), where rank 0 hosts the store.

    A port found free may be taken before rank 0 binds it; rank 0 then fails to rendezvous and the
    unit is restarted on another port, as after any other death.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"
