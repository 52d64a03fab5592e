"""Engine configuration: one strict struct, validated when it is built."""

from __future__ import annotations

import typing
from typing import Literal

import msgspec

from specroll.engine.loaders.registry import DEFAULT_MODEL
from specroll.engine.spec.tree import TreeShape

BackendName = Literal["auto", "torch", "flashinfer"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
DraftLength = Literal["fixed", "adaptive", "tree"]
CudaGraphs = Literal["off", "on", "emulate"]
Compile = Literal["off", "on"]

MAX_DRAFT_TOKENS = 32
"""Most draft tokens per sequence and step: each is a K/V slot, a target row and a head pass,
and acceptance falls geometrically with depth (EAGLE and vLLM run 1–10)."""
MAX_NUM_THREADS = 1024
"""Most torch CPU threads a role may ask for: OpenMP cannot create ~100,000 (libgomp's thread creation
fails and the process dies with SIGSEGV), and no machine this runs on has more than a few hundred cores."""
MAX_TOKENS = 1 << 20
"""Most tokens of a context (``max_model_len``) or of one step (``max_num_batched_tokens``): the wire's
longest sequence (``protocol.limits.MAX_SEQUENCE_TOKENS``)."""
MAX_NUM_SEQS = 1 << 16
"""Most sequences decoded in one step (``max_num_seqs``; a group's samples, ``protocol.limits.MAX_GROUP_SIZE``)."""
MAX_KV_CACHE_GB = 4096.0
"""Most GiB the KV cache may be asked to allocate (``kv_cache_memory_gb``)."""


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything an :class:`~specroll.engine.engine.Engine` needs to start.

    Raises:
        ValueError: on construction, naming the field, when a value is out of range.
    """

    model: str = DEFAULT_MODEL
    """A registered model name, a Hugging Face checkpoint directory or a ``.gguf`` file."""
    backend: BackendName = "auto"
    """Attention backend: ``torch`` (reference, CPU), ``flashinfer`` (CUDA) or ``auto``."""
    device: str = "cpu"
    """Torch device the weights and KV cache live on."""
    dtype: DTypeName = "auto"
    """Weight and KV dtype; ``auto`` is bfloat16 on CUDA and on CPUs with native bf16, else float32.
    float32 is the reference: the parity tests run in it."""
    page_size: int = 16
    """Tokens per KV-cache page: a power of two, at most 4096."""
    kv_cache_memory_gb: float = 1.0
    """Memory given to the paged KV cache, in GiB (at most 4096); the number of pages follows from it."""
    max_num_seqs: int = 64
    """Most sequences decoded in one step, 1 to 65536."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens), 1 to 1,048,576."""
    max_model_len: int | None = None
    """Context length cap in tokens (at most 1,048,576); ``None`` takes the checkpoint's."""
    enable_prefix_caching: bool = True
    """Share full prompt pages between requests (the n samples of a group prefill once)."""
    seed: int = 0
    """Seed for requests that bring none of their own."""
    num_threads: int | None = None
    """Intra-op CPU threads for torch; ``None`` leaves torch's default."""
    num_draft_tokens: int = 4
    """Most draft tokens per sequence and step when the engine has a proposer (K), 1 to
    :data:`MAX_DRAFT_TOKENS`."""
    draft_length: DraftLength = "fixed"
    """``fixed``: draft a chain of K tokens every step. ``tree``: draft a tree of the first of
    ``draft_trees`` every step (a proposer that drafts trees: ``spec/tree.py``). ``adaptive``:
    choose each step among chains of k in [0, K] and, when the proposer drafts trees, the
    ``draft_trees`` shapes, with a bandit on measured tokens/s per batch-size bucket (0 = plain
    decoding when drafting doesn't pay). Greedy output is the same either way; sampled output keeps
    the target's distribution but, as the choice then depends on timing, is not reproducible run to run."""
    draft_trees: tuple[str, ...] = ("2x4:6:sampled", "4x4:12:sampled")
    """Draft-tree shapes ``DEPTHxWIDTH:NODES`` (:class:`~specroll.engine.spec.tree.TreeShape`): the
    drafter expands the WIDTH likeliest nodes of each depth by their WIDTH likeliest children, DEPTH
    levels deep, and keeps the NODES likeliest (at most 64). ``DEPTHxWIDTH:NODES:sampled``: a sampling
    request's children are drawn from the drafter's q instead and verified by recursive rejection
    sampling over q (``spec/tree.py``), at most NODES in all; a greedy request drafts the same shape
    with top-k children. The default is sampled: at T = 1 sampled children accepted 0.1–0.3 more
    tokens per step than top-k ones at the same node count (docs/benchmarks.md, "Drafter acceptance
    against training budget")."""
    cuda_graphs: CudaGraphs = "off"
    """``on``: replay decode steps and K-draft verify steps as CUDA graphs, one per batch-size bucket,
    captured on first use (``step_graphs.py``; needs ``device`` cuda and the flashinfer backend);
    other steps run eagerly. ``emulate``: the same buckets, padding and static inputs without
    capturing, on any device (to check that path where no GPU is). ``off``: every step eager."""
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    """Batch sizes graphs are captured for; ``()`` takes 1, 2, 4, 8 and every multiple of 16 up to
    ``max_num_seqs`` (always a bucket)."""
    pack_weights: bool = True
    """Give each matmul weight a copy packed for oneDNN (bfloat16 on a CPU only; ``cpu_linear.py``): 1.16x the
    tokens/s of SmolLM2-135M at batch 1 (1.0x at 16), for the copy's memory (as much as the weights)."""
    compile: Compile = "off"
    """``on``: run the decoder layers as one ``torch.compile``d graph (``compiled_step.py``): two graphs
    (one token, any other count), each compiled at the first step that needs it — tens of seconds on a
    CPU, logged — or loaded from ``compile_cache_dir``; ``off``: eager (docs/generating.md, "Compiled
    steps and packed weights", says where it pays)."""
    compile_cache_dir: str | None = None
    """Where compiled code is kept between runs; ``None``: ``$XDG_CACHE_HOME/specroll/compile``
    (``~/.cache/specroll/compile``)."""

    @property
    def tree_shapes(self) -> tuple[TreeShape, ...]:
        """``draft_trees`` parsed."""
        return tuple(TreeShape.parse(text) for text in self.draft_trees)

    def __post_init__(self) -> None:
        for name, kind in (("backend", BackendName), ("dtype", DTypeName), ("draft_length", DraftLength),
                           ("cuda_graphs", CudaGraphs), ("compile", Compile)):
            allowed = typing.get_args(kind)
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}, expected one of {', '.join(map(repr, allowed))}")
        if not 0 < self.page_size <= 4096 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size}, expected a power of two in [1, 4096]")
        if not 0 < self.kv_cache_memory_gb <= MAX_KV_CACHE_GB:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb}, expected a number of GiB in "
                             f"(0, {MAX_KV_CACHE_GB:g}]")
        if not 0 < self.max_num_seqs <= MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}, expected an integer in [1, {MAX_NUM_SEQS}]")
        if not 0 < self.max_num_batched_tokens <= MAX_TOKENS:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}, expected an integer in "
                             f"[1, {MAX_TOKENS}]")
        if self.max_model_len is not None and not 0 < self.max_model_len <= MAX_TOKENS:
            raise ValueError(f"max_model_len={self.max_model_len}, expected an integer in [1, {MAX_TOKENS}] or None")
        if not 0 < self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}, expected an integer from 1 to "
                             f"{MAX_DRAFT_TOKENS}")
        if self.draft_length == "tree" and not self.draft_trees:
            raise ValueError("draft_length='tree' needs at least one draft_trees shape, got none")
        for text in self.draft_trees:
            if not isinstance(text, str):
                raise ValueError(f"draft_trees: {text!r}, expected strings 'DEPTHxWIDTH:NODES' such as '5x4:16'")
            TreeShape.parse(text)  # raises naming the shape
        sizes = list(self.cuda_graph_batch_sizes)
        bad_sizes = [s for s in sizes if type(s) is not int or s <= 0]  # a bool is not a size
        if bad_sizes:
            raise ValueError(f"cuda_graph_batch_sizes={sizes}: expected positive integers, got {bad_sizes}")
        if any(s > self.max_num_seqs for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes={sizes}: expected sizes at most max_num_seqs = "
                             f"{self.max_num_seqs} (a larger batch never runs)")
        if self.cuda_graphs == "on" and (not self.device.startswith("cuda") or self.backend == "torch"):
            raise ValueError(f"cuda_graphs='on' needs device 'cuda' and the flashinfer backend; got device "
                             f"{self.device!r}, backend {self.backend!r} ('emulate' runs the graph path "
                             "eagerly on any device)")
        if type(self.pack_weights) is not bool:
            raise ValueError(f"pack_weights={self.pack_weights!r}, expected true or false")
        if self.compile_cache_dir is not None and (not isinstance(self.compile_cache_dir, str)
                                                   or not self.compile_cache_dir.strip()):
            raise ValueError(f"compile_cache_dir={self.compile_cache_dir!r}, expected a directory path or None "
                             "(None: ~/.cache/specroll/compile)")
        if self.num_threads is not None and not 0 < self.num_threads <= MAX_NUM_THREADS:
            raise ValueError(f"num_threads={self.num_threads}, expected an integer in [1, {MAX_NUM_THREADS}] or None")
