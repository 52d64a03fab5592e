"""The target model on its device: weights, paged KV cache and attention backend, and one forward
per engine step.

The runner turns a scheduled batch (prefill chunks, decodes, decodes carrying drafts) into one
ragged forward over the paged KV cache, described in FlashInfer's layout (``batch.py``), and
returns the logits of the rows that sample plus the target features a proposer taps. It owns no
request state: which tokens run is the scheduler's, what the logits become is the sampler's and the
verifier's. The split follows nano-vllm's ``model_runner.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specroll.engine import cpu_linear
from specroll.engine.attention import allocate_kv_cache, flashinfer_problem, kv_bytes_per_page, select_backend
from specroll.engine.batch import build_metadata
from specroll.engine.compiled_step import ATTENTION, CompiledLayers, usable_cache_dir
from specroll.engine.config import EngineConfig
from specroll.engine.flashinfer_attention import FlashInferAttention
from specroll.engine.loaders.checkpoint import Checkpoint
from specroll.engine.model import CausalLM, PagedLayers
from specroll.engine.model_config import expected_weight_shapes
from specroll.engine.paged_forward import paged_layers
from specroll.engine.scheduler import ScheduledSequence
from specroll.engine.sequence import Sequence
from specroll.engine.spec.tree import DraftTree
from specroll.engine.step_graphs import StepGraphs, bucket_sizes, pad_uniform_step


@dataclass(frozen=True)
class StepInputs:
    """One step's batch as the model reads it, on the model's device."""

    input_ids: torch.Tensor
    """int64 ``[T]``: every sequence's new tokens then its drafts, concatenated."""
    positions: torch.Tensor
    """int64 ``[T]``: their positions."""
    logits_rows: torch.Tensor
    """int64 ``[R]``: the input rows whose logits are sampled or verified."""
    graph: tuple[int, int] | None = None
    """``(bucket, q_len)`` when the step replays a graph (``step_graphs.py``): the ids and positions
    are then padded to ``bucket · q_len`` rows; None: an eager step."""


class ModelRunner:
    """Builds the target model and its KV cache, and runs each step's batch through them.

    Args:
        config: the engine's settings (page size, KV memory, context cap, attention backend).
        checkpoint: the target's config and weights.
        device: where the weights and the KV cache live.
        dtype: the weights' and the KV cache's dtype.

    Raises:
        ValueError: the KV-cache memory holds too few pages to serve one full-length request, or the
            attention backend cannot run here (``select_backend``).
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
        model_config = checkpoint.config
        self.device = device
        self.page_size = config.page_size
        with torch.device("meta"):  # no random init: every parameter is loaded below
            model = CausalLM(model_config).to(dtype=dtype)
        self.model = model.to_empty(device=device).eval()
        self.model.load_weights(checkpoint.weights)
        pack = config.pack_weights and cpu_linear.packing_problem(device, dtype) is None
        self.packed_bytes = self.model.pack_matmul_weights() if pack else 0
        """Bytes of the oneDNN-packed weight copies (``cpu_linear.py``; 0: none, not a bf16 CPU engine)."""
        self._weight_shapes = expected_weight_shapes(model_config)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        page_bytes = kv_bytes_per_page(model_config, config.page_size, dtype)
        total_pages = int(config.kv_cache_memory_gb * 2**30) // page_bytes
        # Graph padding writes to scratch pages of its own at the end of the cache, which no
        # request is given: the page count the block manager hands out leaves them out.
        num_scratch = -(-(config.num_draft_tokens + 1) // config.page_size) if config.cuda_graphs != "off" else 0
        self.num_pages = total_pages - num_scratch
        """Pages requests may use (the cache holds ``scratch_pages`` besides)."""
        if self.num_pages * config.page_size < self.max_model_len:
            scratch = f" ({num_scratch} of them kept as the CUDA-graph padding's scratch)" if num_scratch else ""
            raise ValueError(
                f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds {total_pages} pages of "
                f"{config.page_size} tokens{scratch}, fewer than one {self.max_model_len}-token request needs; "
                "raise kv_cache_memory_gb or lower max_model_len"
            )
        self.scratch_pages = list(range(self.num_pages, total_pages))
        self.graphs: StepGraphs | None = None
        if config.cuda_graphs != "off":
            sizes = bucket_sizes(config.max_num_seqs, config.cuda_graph_batch_sizes)
            self.graphs = StepGraphs(sizes, (1, config.num_draft_tokens + 1), device,
                                     capture=config.cuda_graphs == "on")
        self.kv_caches = allocate_kv_cache(model_config, total_pages, config.page_size, dtype, device)
        self.backend = select_backend(config.backend, model_config, device, dtype)
        if config.cuda_graphs == "on":
            if not isinstance(self.backend, FlashInferAttention):
                why = flashinfer_problem(device, dtype, model_config.head_dim)
                raise ValueError(f"cuda_graphs='on' needs the flashinfer backend, which {why}")
            self.backend.enable_graphs(max_pages_per_seq=-(-self.max_model_len // config.page_size))
        self.layers: PagedLayers = paged_layers
        """How the decoder layers run: eager, or compiled (``compile = "on"``)."""
        if config.compile == "on":
            for cache in self.kv_caches:  # the compiled layer's attention op finds the planned backend here
                setattr(cache, ATTENTION, self.backend)
            cache_dir = usable_cache_dir(config.compile_cache_dir)
            self.layers = CompiledLayers(cache_dir, opaque_matmuls=self.packed_bytes > 0)
        self.feature_layers: tuple[int, ...] = ()
        """Layers whose features each forward taps for the proposer (``CausalLM.forward``); ``()``: none."""

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named_tensors`` (Hugging Face names) into the model, cast to its dtype; every tensor
        is checked before any is copied, so a bad update changes nothing.

        Raises:
            ValueError: unknown name, wrong shape or non-floating dtype, naming the tensor.
        """
        for name, tensor in named_tensors.items():
            shape = self._weight_shapes.get(name)
            if shape is None:
                raise ValueError(f"weight update: unknown tensor {name!r}; expected a name of the model's state dict")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"weight update: {name} has shape {tuple(tensor.shape)}, expected {shape}")
            if not tensor.is_floating_point():
                raise ValueError(f"weight update: {name} has dtype {tensor.dtype}, expected a floating dtype")
        self.model.load_weights(named_tensors)

    def run(
        self, scheduled: list[ScheduledSequence], drafts: dict[Sequence, list[int]], *, to_cpu: bool,
        trees: dict[Sequence, DraftTree] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`prepare` then :meth:`forward`: one forward over the step's batch."""
        return self.forward(self.prepare(scheduled, drafts, trees), to_cpu=to_cpu)

    def prepare(
        self, scheduled: list[ScheduledSequence], drafts: dict[Sequence, list[int]],
        trees: dict[Sequence, DraftTree] | None = None,
    ) -> StepInputs:
        """The step's inputs: each scheduled sequence's new tokens, then its drafts; attention is
        planned for them (the backend holds the plan until the next ``prepare``).

        Args:
            scheduled: the step's batch.
            drafts: drafted token ids of the sequences that carry drafts (a chain, or a tree's
                nodes in node order).
            trees: the sequences whose drafts form a tree (``spec/tree.py``): their nodes sit at
                the position of their depth and attend to their ancestors only; their K/V fills
                the slots after the last token in node order (:meth:`keep_tree_path` compacts it).
        """
        input_ids, logits_rows, q_lens, kv_lens = self._prepare(scheduled, drafts)
        tables = [s.seq.block_table for s in scheduled]
        graph = None if trees else self._graph_of(q_lens)  # tree steps run eagerly
        if graph is not None:
            padded = pad_uniform_step(input_ids, graph[1], kv_lens, tables, graph[0], self.scratch_pages)
            input_ids, q_lens, kv_lens, tables = padded.input_ids, padded.q_lens, padded.kv_lens, padded.block_tables
        masks, positions = None, None
        if trees:
            masks, positions = self._tree_layout(scheduled, trees, q_lens, kv_lens)
        meta = build_metadata(q_lens, kv_lens, tables, self.page_size, masks)
        # only a captured step plans into a bucket's fixed buffers; an emulated one plans as any step
        self.backend.plan(meta, graph if self.graphs is not None and self.graphs.capture else None)
        return StepInputs(
            torch.tensor(input_ids, device=self.device),
            (meta.positions() if positions is None else positions).to(self.device),
            torch.tensor(logits_rows, dtype=torch.long, device=self.device), graph,
        )

    @staticmethod
    def _tree_layout(
        scheduled: list[ScheduledSequence], trees: dict[Sequence, DraftTree], q_lens: list[int], kv_lens: list[int]
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Tree masks ``{b: bool [q_len, q_len]}`` over each tree sequence's new rows, and the RoPE
        positions int64 ``[T]`` of every row (a node at ``root position + depth``)."""
        masks, positions = {}, []
        for b, (s, q_len, kv_len) in enumerate(zip(scheduled, q_lens, kv_lens, strict=True)):
            tree = trees.get(s.seq)
            start = kv_len - q_len
            if tree is None or not len(tree):
                positions.extend(range(start, kv_len))
                continue
            new = s.num_new_tokens  # the last of them is the root
            root = start + new - 1
            positions.extend(range(start, root + 1))
            positions.extend(root + d for d in tree.depths())
            ancestors = tree.ancestor_mask()  # [N+1, N+1] over (root, nodes)
            mask = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
            mask[new - 1 :, new - 1 :] = ancestors
            masks[b] = mask
        return masks, torch.tensor(positions)

    def keep_tree_path(self, seq: Sequence, root_position: int, path: list[int]) -> None:
        """Move the K/V of a tree's accepted nodes (node indices ``path``, by depth) from their
        verify slots ``root_position + 1 + node`` to ``root_position + 1 + depth − 1``, in every
        layer's cache; the caller then rolls back the slots after the path."""
        moves = [(root_position + 1 + node, root_position + 1 + d) for d, node in enumerate(path) if node != d]
        if not moves:
            return
        ps = self.page_size
        table = seq.block_table

        def rows(slots: list[int]) -> list[int]:  # K row then V row of each slot in the flat cache
            return [r for slot in slots for r in (table[slot // ps] * 2 * ps + slot % ps,
                                                  table[slot // ps] * 2 * ps + ps + slot % ps)]

        src = torch.tensor(rows([m[0] for m in moves]), device=self.device)
        dst = torch.tensor(rows([m[1] for m in moves]), device=self.device)
        for cache in self.kv_caches:
            flat = cache.view(-1, *cache.shape[-2:])  # [P·2·ps, H_kv, D]
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def _graph_of(self, q_lens: list[int]) -> tuple[int, int] | None:
        """``(bucket, q_len)`` when this step replays a graph: every sequence has the same graphed
        ``q_len`` and the batch fits a bucket; else None (an eager step)."""
        if self.graphs is None or min(q_lens) != max(q_lens):
            return None
        bucket = self.graphs.bucket(len(q_lens), q_lens[0])
        return None if bucket is None else (bucket, q_lens[0])

    def forward(
        self, inputs: StepInputs, *, to_cpu: bool, hidden_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prepared batch: writes the K/V of every input row (drafts included) to the cache;
        does not advance any sequence's ``num_computed_tokens``.

        Args:
            inputs: from :meth:`prepare`, for this step.
            to_cpu: return the logits on the CPU (the torch sampler), else on the model's device.
            hidden_only: return the final (normed) hidden states ``[rows, hidden_size]`` of those
                rows instead of their logits, on the model's device (an eager step only): the
                caller runs the LM head on the rows it needs (``CausalLM.compute_logits``).

        Returns:
            float32 logits ``[rows, V]`` at each sampling sequence's last token and at each of its
            drafts (``1 + len(drafts)`` rows per sampling sequence, in batch order), and the target
            features ``[input rows, len(feature_layers) * hidden_size]`` of every input row, or None
            without ``feature_layers``.
        """
        if inputs.graph is None:
            hidden, features = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.backend,
                                          self.feature_layers, self.layers)
            if hidden_only:
                return hidden[inputs.logits_rows], features
            logits = self.model.compute_logits(hidden[inputs.logits_rows])
        else:
            assert self.graphs is not None  # a graph step is prepared only with graphs on
            bucket, q_len = inputs.graph
            all_logits, features = self.graphs.run(bucket, q_len, inputs.input_ids, inputs.positions, self._graph_step)
            logits = all_logits[inputs.logits_rows]  # the real rows come first; padding rows are dropped
        return (logits.cpu() if to_cpu else logits), features

    def _graph_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The graphed computation: the forward and the LM head over every (padded) row."""
        hidden, features = self.model(input_ids, positions, self.kv_caches, self.backend, self.feature_layers,
                                      self.layers)
        return self.model.compute_logits(hidden), features

    def _prepare(
        self, scheduled: list[ScheduledSequence], drafts: dict[Sequence, list[int]]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The step's input token ids, the input rows whose logits are needed, and each sequence's
        new tokens (q_len) and K/V length after the step."""
        input_ids: list[int] = []
        logits_rows: list[int] = []
        q_lens: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            extra = drafts.get(s.seq, [])
            input_ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
            input_ids.extend(extra)
            q_lens.append(s.num_new_tokens + len(extra))
            assert start + q_lens[-1] <= self.max_model_len, f"{s.seq.request_id} would pass the context"  # slots
            if s.samples:  # the last new token's row and each draft's row
                logits_rows.extend(range(len(input_ids) - len(extra) - 1, len(input_ids)))
        kv_lens = [s.seq.num_computed_tokens + q for s, q in zip(scheduled, q_lens, strict=True)]
        return input_ids, logits_rows, q_lens, kv_lens
