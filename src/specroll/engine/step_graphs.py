"""Decode and verify steps replayed as CUDA graphs, one per batch-size bucket and query length.

A decode step of a small model on a GPU is launch-bound: ~450 kernel launches and their Python
around them cost more than the kernels. A CUDA graph records the launches of one forward once and
replays them with one call (the technique of vLLM's and SGLang's CUDA-graph runners). A graph
freezes shapes and addresses, so:

- **Buckets.** Steps whose sequences all have the same ``q_len`` — every decode step (1) and every
  verify of ``k`` drafts each (``k + 1``) — are padded up to the smallest batch-size bucket that
  holds them (:func:`bucket_sizes`: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``). Anything
  else — prefill chunks, mixed batches, a verify where some sequence drafted fewer, a batch
  above the largest bucket — runs eagerly, as without graphs.
- **Padding** (:func:`pad_uniform_step`): each padding sequence holds ``q_len`` tokens (id 0 at
  positions 0..q_len−1) on the engine's scratch pages, which no request owns, so its K/V writes
  land there and its logits are dropped; the real sequences come first and keep their rows.
- **Static inputs.** Token ids and positions are copied into buffers whose addresses the graph
  recorded; the attention backend plans the padded batch outside the graph, before every replay,
  into buffers of its own (FlashInfer's wrappers in CUDA-graph mode). The graph computes the
  logits of every row (and the proposer's features); the engine reads the real rows right after
  the replay and samples there.
- **Capture** happens the first time a bucket is used: two eager warm-up runs (which write the
  same K/V to the same slots as the captured run will), then the capture. On a CPU there is no
  graph: :class:`EagerReplay` runs the same padded, static-buffer step eagerly, which is how the
  bucketing and padding are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

GraphOutputs = tuple[torch.Tensor, torch.Tensor | None]
"""A replayed step's logits of every row ``[rows, V]`` float32, and its features or None."""


def bucket_sizes(max_num_seqs: int, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: ``configured`` (sizes above ``max_num_seqs``
    dropped), or by default 1, 2, 4, 8 and every multiple of 16 up to ``max_num_seqs``, which is
    always a bucket itself; ascending, without repeats.

    Raises:
        ValueError: a configured size is not a positive integer.
    """
    bad = [s for s in configured if s <= 0]
    if bad:
        raise ValueError(f"cuda_graph_batch_sizes {list(configured)}: expected positive integers, got {bad}")
    if configured:
        return tuple(sorted({s for s in configured if s <= max_num_seqs}))
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16)) | {max_num_seqs}
    return tuple(sorted(sizes))


def pick_bucket(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch`` sequences, or None when ``batch`` exceeds them all."""
    for size in sizes:
        if size >= batch:
            return size
    return None


@dataclass(frozen=True)
class PaddedStep:
    """A uniform step padded to its bucket: the real sequences first, then the padding ones."""

    input_ids: list[int]
    """``bucket · q_len`` token ids."""
    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    num_real: int
    """Real sequences (the first rows' owners)."""


def pad_uniform_step(
    input_ids: Sequence[int], q_len: int, kv_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
    bucket: int, scratch_pages: Sequence[int],
) -> PaddedStep:
    """Pad a step whose ``len(kv_lens)`` sequences each have ``q_len`` new tokens to ``bucket`` sequences.

    Args:
        input_ids: the real sequences' new tokens, ``len(kv_lens) · q_len`` of them, in batch order.
        q_len: new tokens per sequence.
        kv_lens: each real sequence's K/V length after the step.
        block_tables: each real sequence's pages.
        bucket: the padded batch size (≥ the real one).
        scratch_pages: pages no request owns, at least ``q_len`` tokens' worth: every padding
            sequence writes its K/V there (the writes race harmlessly: nothing reads them).

    Raises:
        ValueError: the step does not fit the bucket, the token count disagrees, or the scratch
            pages are too few.
    """
    b = len(kv_lens)
    if not 0 < b <= bucket:
        raise ValueError(f"{b} sequences do not fit a bucket of {bucket}")
    if len(input_ids) != b * q_len or len(block_tables) != b:
        raise ValueError(f"{len(input_ids)} token ids and {len(block_tables)} block tables for {b} sequences "
                         f"of {q_len} new tokens each")
    if not scratch_pages:
        raise ValueError("padding needs at least one scratch page")
    pad = bucket - b
    return PaddedStep(
        input_ids=[*input_ids, *[0] * (pad * q_len)],
        q_lens=[q_len] * bucket,
        kv_lens=[*kv_lens, *[q_len] * pad],
        block_tables=[*(list(t) for t in block_tables), *[list(scratch_pages)] * pad],
        num_real=b,
    )


class Replay(Protocol):
    """Records a step function once and re-runs it."""

    def __call__(self) -> GraphOutputs:
        ...


class EagerReplay:
    """Runs the step function again at every replay: the graph path's semantics (static buffers,
    padding, buckets) without a graph, on any device."""

    def __init__(self, step: Callable[[], GraphOutputs]) -> None:
        self._step = step

    def __call__(self) -> GraphOutputs:
        return self._step()


class CudaGraphReplay:
    """A CUDA graph of the step function, captured after two eager warm-up runs on a side stream
    (``torch.cuda.graphs`` docs, "Whole-network capture"); its outputs are static tensors the
    replay overwrites.

    Args:
        step: the function to capture; reads only static buffers, makes no host synchronisation.
        pool: the memory pool shared by every graph of the engine (one replays at a time).
    """

    def __init__(self, step: Callable[[], GraphOutputs], pool: object) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            self._outputs = step()

    def __call__(self) -> GraphOutputs:
        self._graph.replay()
        return self._outputs


class StepGraphs:
    """The captured steps of one engine, keyed by (bucket, q_len), and their static inputs.

    Args:
        sizes: the batch-size buckets (:func:`bucket_sizes`).
        query_lens: the ``q_len`` values graphed (1 for decode, ``K + 1`` for verify).
        device: where the static inputs live (the model's device).
        capture: capture CUDA graphs (``device`` must be CUDA); False replays eagerly
            (:class:`EagerReplay`: ``cuda_graphs = "emulate"``).

    Raises:
        ValueError: no bucket (every configured size above ``max_num_seqs``), or capture off CUDA.
    """

    def __init__(self, sizes: Sequence[int], query_lens: Sequence[int], device: torch.device,
                 capture: bool = False) -> None:
        if not sizes:
            raise ValueError("no CUDA-graph bucket: expected at least one batch size")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on a CUDA device, not {device}")
        self.capture = capture
        self.sizes = tuple(sizes)
        self.query_lens = frozenset(query_lens)
        self.device = device
        most = max(self.sizes) * max(self.query_lens)
        self._input_ids = torch.zeros(most, dtype=torch.long, device=device)  # [rows] static
        self._positions = torch.zeros(most, dtype=torch.long, device=device)  # [rows] static
        self._replays: dict[tuple[int, int], Replay] = {}
        self.num_replays = 0
        """Steps run through a graph so far."""
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, batch: int, q_len: int) -> int | None:
        """The bucket a uniform step of ``batch`` sequences × ``q_len`` tokens replays in, or None."""
        return pick_bucket(batch, self.sizes) if q_len in self.query_lens else None

    def run(
        self, bucket: int, q_len: int, input_ids: torch.Tensor, positions: torch.Tensor,
        step: Callable[[torch.Tensor, torch.Tensor], GraphOutputs],
    ) -> GraphOutputs:
        """Copy the padded step's ``input_ids`` and ``positions`` (int64 ``[bucket · q_len]``) into the
        static inputs and replay the (bucket, q_len) graph, capturing ``step`` over the static
        inputs the first time. The attention backend must already be planned for this step.
        """
        rows = bucket * q_len
        ids, pos = self._input_ids[:rows], self._positions[:rows]
        ids.copy_(input_ids, non_blocking=True)
        pos.copy_(positions, non_blocking=True)
        replay = self._replays.get((bucket, q_len))
        if replay is None:
            body = lambda: step(ids, pos)  # noqa: E731
            replay = CudaGraphReplay(body, self._pool) if self.capture else EagerReplay(body)
            self._replays[(bucket, q_len)] = replay
        self.num_replays += 1
        return replay()

    def captured(self) -> list[tuple[int, int]]:
        """The ``(bucket, q_len)`` graphs captured so far, in capture order."""
        return list(self._replays)
