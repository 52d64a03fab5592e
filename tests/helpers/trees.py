"""Shared pieces of the tree speculation tests: prompts, a run, an EAGLE tree engine, a chi-square test."""

from __future__ import annotations

import functools

import torch

from helpers import engines
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.sampling import SamplingParams

PAGE = 8
make_engine = functools.partial(engines.make_engine, **engines.TREE_SPECULATION)


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, batch: list[list[int]], sampling: SamplingParams, groups: bool = False):
    for i, p in enumerate(batch):
        engine.add_request(p, sampling, f"r{i}", group_id=f"g{i // 2}" if groups else None)
    return run_to_completion(engine)


def eagle_engine(path, shape: str, **kw):
    from helpers.drafters import make_head
    from specroll.drafter.eagle import EagleProposer
    from specroll.engine.loaders.checkpoint import load_checkpoint

    head = make_head(load_checkpoint(str(path)).config, taps="eagle3")
    proposer = EagleProposer(head, page_size=PAGE, kv_cache_memory_gb=0.01, sample_drafts=False)
    return make_engine(path, proposer, draft_trees=(shape,), **kw), proposer


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square test of counts against probabilities: the upper tail
    Q(dof/2, x/2) of the chi-square distribution with len − 1 degrees of freedom."""
    n = sum(observed)
    x = sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, expected, strict=True))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))
