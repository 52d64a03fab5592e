"""The engine a run config describes for one generator (:func:`build_engine`)."""

from __future__ import annotations

from specroll.actors.config import RunConfig
from specroll.actors.generator.drafter_swap import check_drafter_cache
from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig
from specroll.drafter.suffix import SuffixProposer
from specroll.engine.engine import Engine


def build_engine(config: RunConfig) -> tuple[Engine, DraftCounter | None]:
    """``Engine(config.generator.engine)``, with a proposer (and its draft counter) when speculating:
    the suffix proposer, or the EAGLE drafter of :meth:`RunConfig.served_drafter` (its K/V in
    ``drafter.kv_cache_gb``, which must hold one request: :func:`check_drafter_cache`, checked for
    the drafter served from the start or, before the first version arrives, for one shaped like a
    layer of the model, as a cold start's is).

    Raises:
        CheckpointError, ValueError: the model cannot be loaded or a setting is out of range.
        DrafterError: the drafter directory holds no drafter, or one made for another model; or
            ``drafter.kv_cache_gb`` cannot hold one request's drafter K/V.
    """
    engine_config = config.generator.engine
    counter = None
    drafter = config.served_drafter()
    if config.speculative() == "suffix":
        counter = DraftCounter(SuffixProposer())
    elif drafter is not None:
        counter = DraftCounter(EagleProposer(drafter, kv_cache_memory_gb=config.drafter.kv_cache_gb,
                                             page_size=engine_config.page_size, seed=engine_config.seed))
    engine = Engine(engine_config, proposer=counter)
    if config.speculative() == "eagle":
        inner = counter.inner if counter is not None else None
        model = engine.model_config
        head = inner.head.config if isinstance(inner, EagleProposer) else EagleConfig.for_target(
            model, (model.num_layers,), min(config.drafter.draft_vocab_size, model.vocab_size))
        check_drafter_cache(config.drafter.kv_cache_gb, engine, head)
    return engine, counter
