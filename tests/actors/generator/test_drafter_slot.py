"""The generator's drafter slot (``drafter_swap.py``, ``engine_build.py``): a ``drafter.kv_cache_gb``
too small for one request is refused at start and at a swap to a drafter of a new shape."""

from __future__ import annotations

import pytest
import torch

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig
from specroll.drafter.eagle_config import EagleConfig
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.config import EngineConfig


def test_drafter_kv_cache_too_small_for_one_request_is_refused_at_start(tiny_llama):
    """A generator drafting with ``eagle`` refuses a ``drafter.kv_cache_gb`` that cannot hold one
    request's head K/V (else every request would go undrafted, silently): at start, and when a
    drafter version of a new shape arrives."""
    from specroll.actors.config import GeneratorConfig
    from specroll.actors.generator.drafter_swap import DrafterSlot, ReadyDrafter
    from specroll.actors.generator.engine_build import build_engine
    from specroll.drafter.eagle_config import DrafterError

    def config(kv_cache_gb: float, trees: tuple[str, ...] = ("2x2:4",)) -> RunConfig:
        engine = EngineConfig(kv_cache_memory_gb=0.01, dtype="float32", page_size=16, max_model_len=256,
                              draft_trees=trees)
        return RunConfig(model=ModelSection(name=str(tiny_llama)), generator=GeneratorConfig(
            speculative="eagle", engine=engine), drafter=DrafterConfig(enabled=True, kv_cache_gb=kv_cache_gb))

    # one layer, 2 KV heads x 16, float32: 256 bytes a position; 256 + 3 draft positions = 17 pages = 69632 bytes
    with pytest.raises(DrafterError, match=r"^drafter.kv_cache_gb=1e-05 holds the drafter's K/V for 32 positions, "
                                           r"fewer than one request needs: 256 tokens .* = 259; expected "
                                           r"drafter.kv_cache_gb >= 6.5e-05"):
        build_engine(config(1e-5))
    # a draft tree of depth 6 and width 4 steps the head through (6 - 1) * 4 rows past the last verified one
    with pytest.raises(DrafterError, match=r"256 tokens .* \+ 20 draft positions = 276;"):
        build_engine(config(6.5e-5, ("3x1:3", "6x4:16")))
    engine, counter = build_engine(config(6.5e-5))  # the least it names is enough
    assert counter is None  # a cold start: the first version arrives from the drafter trainer
    head = EagleHead.init(EagleConfig.for_target(engine.model_config, (2,), 64), torch.arange(64))
    ack = DrafterSlot(engine, None, kv_cache_memory_gb=1e-5).swap(ReadyDrafter(1, "c" * 64, head))
    assert "drafter.kv_cache_gb=1e-05" in ack.refused, ack
    assert not DrafterSlot(engine, None, kv_cache_memory_gb=6.5e-5).swap(ReadyDrafter(1, "c" * 64, head)).refused
