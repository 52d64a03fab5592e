"""Which rank of a sharded trainer this process is, and joining its ``torch.distributed`` group.

A trainer with ``trainer.world_size = N > 1`` runs as N processes (ranks). Each learns its place
from, in this order:

1. the command line: ``--rank R --world-size N --master ADDR:PORT [--local-rank L]`` — what
   ``specroll launch`` passes (roles are forked from the launcher, so argv is their clean way in);
2. the environment ``torchrun`` sets: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
   (and ``LOCAL_RANK``), so ``torchrun --nproc-per-node N -m specroll.actors.trainer --config FILE``
   (or ``torchrun ... --no-python specroll trainer --config FILE``) works the same.

Ranks meet at ``MASTER_ADDR:MASTER_PORT``: a ``TCPStore`` that rank 0 serves on that address only
(or torchrun's agent's store, found with ``torch.distributed.rendezvous``), then
``init_process_group`` on that store: ``gloo`` on the CPU, ``nccl`` on CUDA (rank r on
``cuda:LOCAL_RANK``). The store also carries rank 0's commands (``rank_channel.py``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

TORCHRUN_HINT = ("start the ranks with `specroll launch CONFIG` or "
                 "`torchrun --nproc-per-node N -m specroll.actors.trainer --config CONFIG`")
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective (or the rendezvous) may wait for a rank before it fails."""


class RankError(ValueError):
    """The ranks started do not fit the config or each other (the trainer exits 2)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    """Its index on its host (its CUDA device with ``trainer.device = "cuda"``)."""
    source: str
    """Where they came from, for messages: ``"--rank/--world-size/--master"`` or ``"torchrun's environment"``."""

    @property
    def init_method(self) -> str:
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"tcp://{host}:{self.master_port}"


def resolve_ranks(rank: int | None, world_size: int | None, master: str | None, local_rank: int | None,
                  env: Mapping[str, str], configured: int) -> Ranks | None:
    """The ranks from the command-line flags (all of ``rank``, ``world_size``, ``master`` given, as
    ``ADDR:PORT``) or else from torchrun's environment; None for a one-rank trainer (no process group).

    Args:
        configured: ``trainer.world_size`` of the config: it must equal the ranks started.

    Raises:
        RankError: flags given only in part, an environment missing one of its variables, a value
            out of range, a world size other than ``configured``, or ``configured`` > 1 with no
            rank given at all (the message says how to start the ranks).
    """
    flags = {"--rank": rank, "--world-size": world_size, "--master": master}
    if any(v is not None for v in (*flags.values(), local_rank)):
        missing = [name for name, value in flags.items() if value is None]
        if missing:
            raise RankError(f"{', '.join(missing)} missing: --rank, --world-size and --master go together")
        assert rank is not None and world_size is not None and master is not None
        addr, sep, port = master.rpartition(":")
        if not sep or not addr or not port.isdigit():
            raise RankError(f"--master {master!r}, expected ADDR:PORT")
        found = Ranks(rank, world_size, addr.strip("[]"), int(port),
                      rank if local_rank is None else local_rank, "--rank/--world-size/--master")
    elif "RANK" in env or "WORLD_SIZE" in env:
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in names if name not in env]
        if missing:
            raise RankError(f"torchrun's environment is incomplete: {', '.join(missing)} unset (RANK, WORLD_SIZE, "
                            "MASTER_ADDR and MASTER_PORT go together)")
        values = {name: env[name] for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        values["LOCAL_RANK"] = env.get("LOCAL_RANK", env["RANK"])
        for name, value in values.items():
            if not value.isdigit():
                raise RankError(f"{name}={value!r} in the environment, expected a non-negative integer")
        found = Ranks(int(values["RANK"]), int(values["WORLD_SIZE"]), env["MASTER_ADDR"], int(values["MASTER_PORT"]),
                      int(values["LOCAL_RANK"]), "torchrun's environment")
    else:
        if configured > 1:
            raise RankError(f"trainer.world_size = {configured}, but no rank was given; {TORCHRUN_HINT}")
        return None
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise RankError(f"rank {found.rank} of world size {found.world_size} ({found.source}), expected "
                        "world size >= 1 and 0 <= rank < world size")
    if not 0 < found.master_port < 65536:
        raise RankError(f"master port {found.master_port} ({found.source}), expected a port in [1, 65535]")
    if found.local_rank < 0:
        raise RankError(f"local rank {found.local_rank} ({found.source}), expected an integer >= 0")
    if found.world_size != configured:
        started = f"{found.world_size} rank{'s were' if found.world_size != 1 else ' was'} started"
        raise RankError(f"trainer.world_size = {configured} in the config, but {started} ({found.source}); set "
                        f"trainer.world_size = {found.world_size} or start {configured} "
                        f"rank{'s' if configured != 1 else ''}")
    return None if found.world_size == 1 else found


def rank_device(ranks: Ranks | None, device: Literal["cpu", "cuda"]) -> torch.device:
    """Where this rank trains: the CPU, or ``cuda:LOCAL_RANK`` (``cuda:0`` for one rank).

    Raises:
        RankError: ``cuda`` without a usable CUDA device for the local rank.
    """
    if device == "cpu":
        return torch.device("cpu")
    index = 0 if ranks is None else ranks.local_rank
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RankError(f"trainer.device = 'cuda' needs CUDA device {index} (local rank {index}), but "
                        f"{found} CUDA device(s) are usable here")
    return torch.device("cuda", index)


def join_group(ranks: Ranks, device: torch.device) -> dist.Store:
    """Rendezvous with the other ranks and start the default process group (``nccl`` on CUDA, else
    ``gloo``); returns the store the ranks share. Blocks until every rank joined (at most
    :data:`GROUP_TIMEOUT`).

    Raises:
        OSError: rank 0 cannot listen on the master address (e.g. its port is taken).
        torch.distributed.DistError: the rendezvous failed or timed out.
    """
    store = _rank_store(ranks)
    if device.type == "cpu":
        _gloo_on_loopback(ranks.master_addr)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=ranks.rank, world_size=ranks.world_size,
                            timeout=GROUP_TIMEOUT, device_id=device if device.type == "cuda" else None)
    return store


def _rank_store(ranks: Ranks) -> dist.Store:
    """The store the ranks share: torchrun's agent's (``dist.rendezvous`` finds it), or else one
    rank 0 serves on the master address only — a ``TCPStore`` opening its own socket would listen on
    every interface, and the store carries rank 0's commands."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store, _, _ = next(dist.rendezvous(ranks.init_method, ranks.rank, ranks.world_size, timeout=GROUP_TIMEOUT))
        return store
    host, port = ranks.master_addr, ranks.master_port
    if ranks.rank > 0:
        return dist.TCPStore(host, port, ranks.world_size, False, timeout=GROUP_TIMEOUT)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    return dist.TCPStore(host, port, ranks.world_size, True, timeout=GROUP_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=listener.detach())  # the store owns the socket from now on


def _gloo_on_loopback(master_addr: str) -> None:
    """Ranks that meet on a loopback address (``specroll launch``: all on this host) connect their
    gloo pairs over the loopback interface too, not over whatever the host name resolves to; gloo
    takes its interface only from ``GLOO_SOCKET_IFNAME`` (a value already set is kept)."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback
    except (OSError, ValueError):
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback and names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])
