"""Policy weights over a torch.distributed group: the transport the hub and a generator share (the
wire messages are in ``weights_messages.py``; the hub's end is ``actors/rollout/weights_groups.py``,
the generator's ``actors/generator/weights_group.py``).

**One 2-member group per generator.** The trainer (rank 0) opens a ``TCPStore`` on
``network.host`` (port 0: a free one) for each generator that asks (``JoinWeightsGroup``), and both
build a standalone ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA on both ends) over it,
never the default process group (which a multi-rank trainer uses for its own ranks). A generator
that joins or restarts gets a new group of its own and nobody else waits for it; a generator that
dies breaks only its own group, which the trainer drops when it declares the generator gone. The
price: the trainer sends the bytes once per generator (``G`` sends of ``B`` bytes from rank 0)
instead of one broadcast tree over all of them, which would need every member to stop and rebuild
the group at each join, restart or death — frequent events in a long RL run with supervised
restarts. With a handful of generators per trainer the link of rank 0 is the bound either way.

**A version's bytes** are laid out and checksummed as ``weights_layout.py`` says.

**Failures.** Every operation of a group times out after ``timeout_s`` (``network.heartbeat_timeout_s``),
and a peer that dies fails it at once (its TCP connection resets), so neither side hangs on a dead
peer. The blocking calls run in daemon threads (:func:`in_daemon_thread`): a collective cannot be
cancelled, and a daemon thread never keeps an exiting process alive until its timeout.

**Security.** The store and the group accept connections from anyone who can reach their ports and
run no authentication. Both listen on ``network.host`` only (127.0.0.1 by default; the store is
handed a socket bound there, gloo a device bound there), which must therefore be a cluster-internal
address. The bytes received are only ever read as tensors of the announced, model-bounded shapes.
"""

from __future__ import annotations

import datetime
import socket
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch
import torch.distributed as dist

from specroll.protocol.messages import CollectiveBackend
from specroll.protocol.weights_layout import WeightsLayout, bucket_ranges

T = TypeVar("T")

class CollectiveError(Exception):
    """A weights group could not be built, or one of its operations failed (timeout, peer gone);
    the group is unusable from then on."""


class ChecksumMismatch(Exception):
    """A bucket's bytes differ from the announced CRC-32: the version is refused (the group is fine)."""


# ---- the group ------------------------------------------------------------------------------


@dataclass
class GroupEnd:
    """One member's end of a 2-member weights group (rank 0: the trainer; rank 1: a generator)."""

    name: str
    backend: CollectiveBackend
    rank: int
    pg: Any
    """``ProcessGroupGloo`` or ``ProcessGroupNCCL`` (standalone: not registered with torch.distributed)."""
    store: dist.TCPStore
    """Kept alive with the group; the trainer's is the store server, bound on ``network.host``."""
    device: torch.device
    """Where the broadcast tensors live (``cpu`` for gloo, this process's CUDA device for NCCL)."""


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The trainer's store server for one group, listening on ``host`` only, on a free port
    (``store.port``). A ``TCPStore`` left to open its own socket listens on every interface, so
    this one is handed a socket bound to ``host`` (``master_listen_fd``).

    Raises:
        CollectiveError: it cannot listen there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, 0), family=family)
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the socket from now on
        return dist.TCPStore(host, port, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, OSError) as e:
        raise CollectiveError(f"cannot open a torch.distributed store on {host}: {e}") from e


def build_group(name: str, backend: CollectiveBackend, rank: int, host: str, timeout_s: float,
                store: dist.TCPStore | None = None, port: int = 0) -> GroupEnd:
    """Build this member's end of group ``name``; blocks until both members joined (or ``timeout_s``).

    Args:
        name: the group's name (a prefix of its keys in the store).
        backend: ``gloo`` (sockets bound on ``host``) or ``nccl`` (this process's current CUDA device).
        rank: 0 (the trainer, which passes its ``store`` from :func:`open_store`) or 1 (a generator,
            which connects to the store at ``host:port``).
        timeout_s: the limit of the setup and of every later operation.

    Raises:
        CollectiveError: the store is unreachable, the backend is unavailable, or the other member
            did not join within ``timeout_s``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, 2, False, timeout=timeout)
        prefixed = dist.PrefixStore(name, store)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            device = torch.device("cpu")
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            pg = dist.ProcessGroupGloo(prefixed, rank, 2, options)
    except (RuntimeError, OSError, AttributeError, ValueError) as e:
        raise CollectiveError(f"weights group {name!r} ({backend}, rank {rank}, store {host}:{port or '-'}): "
                              f"{type(e).__name__}: {e}") from e
    return GroupEnd(name, backend, rank, pg, store, device)


def _start_broadcast(group: GroupEnd, t: torch.Tensor) -> Any:
    """Post the broadcast of ``t`` from rank 0; returns its work (wait with :func:`_wait`)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        return group.pg.broadcast([t], opts)
    except RuntimeError as e:
        raise CollectiveError(f"weights group {group.name!r}: broadcast failed: {str(e)[:300]}") from e


def _wait(group: GroupEnd, work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # a timeout, or the other member is gone (connection reset)
        raise CollectiveError(f"weights group {group.name!r}: broadcast failed: {str(e)[:300]}") from e


def send_buckets(group: GroupEnd, flat: torch.Tensor, bucket_bytes: int) -> None:
    """Broadcast ``flat`` (uint8 ``[N]``, CPU) from rank 0, bucket by bucket: each is posted while
    the one before is on its way (NCCL: each is first copied to the group's device).

    Raises:
        CollectiveError: an operation failed or timed out.
    """
    pending = None
    for s, e in bucket_ranges(flat.numel(), bucket_bytes):
        work = _start_broadcast(group, flat[s:e].to(group.device))
        if pending is not None:
            _wait(group, pending)
        pending = work
    if pending is not None:
        _wait(group, pending)


def receive_buckets(group: GroupEnd, layout: WeightsLayout, bucket_bytes: int, checksums: Sequence[int],
                    out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Receive a version broadcast by :func:`send_buckets` and check every bucket's CRC-32 (bucket
    ``i``'s while bucket ``i + 1`` arrives: ``zlib.crc32`` releases the GIL).

    Args:
        out: a buffer to receive into (uint8 ``[total_bytes]`` on the group's device; nothing may
            read it meanwhile): reusing one saves the first-touch page faults of a new one, which
            cost about as much as the transfer on a CPU. None: a new one.

    Returns:
        Name → tensor (wire dtype, announced shape; views of one buffer on the group's device).

    Raises:
        CollectiveError: an operation failed or timed out.
        ChecksumMismatch: a bucket's bytes differ from its checksum (naming the bucket); every
            bucket is still received first, so the group stays in step.
    """
    flat = out if out is not None else torch.empty(layout.total_bytes, dtype=torch.uint8, device=group.device)
    assert flat.shape == (layout.total_bytes,) and flat.device == group.device  # [total_bytes] uint8
    ranges = bucket_ranges(layout.total_bytes, bucket_bytes)
    assert len(ranges) == len(checksums), "bounded by check_announcement"
    bad = []

    def check(i: int) -> None:
        s, e = ranges[i]
        got = zlib.crc32(memoryview(flat[s:e].cpu().numpy()))  # .cpu(): a no-op on gloo
        if got != checksums[i]:
            bad.append(f"bucket {i} (bytes {s}..{e}): CRC-32 {got:#010x}, announced {checksums[i]:#010x}")

    for i, (s, e) in enumerate(ranges):
        work = _start_broadcast(group, flat[s:e])
        if i > 0:
            check(i - 1)
        _wait(group, work)
    if ranges:
        check(len(ranges) - 1)
    if bad:
        raise ChecksumMismatch(f"{len(bad)} of {len(ranges)} buckets corrupted: {'; '.join(bad[:3])}")
    return layout.views(flat)


async def in_daemon_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a new daemon thread, awaited without blocking the event loop; the result or
    the exception is handed back. Cancelling the waiter abandons the thread (a collective cannot be
    interrupted; its own timeout ends it), and as a daemon it never holds the process's exit."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # handed to the waiter
            box["error"] = e
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:
            pass  # the event loop is gone: nobody waits any more

    threading.Thread(target=work, name=f"weights-{getattr(fn, '__name__', 'op')}", daemon=True).start()
    await done.wait()
    if "error" in box:
        raise box["error"]
    return box["result"]


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets of an IPv6 literal removed); 127.0.0.1
    for any other transport."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1"
