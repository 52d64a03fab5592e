"""The engine a run config describes for one generator (:func:`build_engine`)."""

from __future__ import annotations

from specroll.actors.config import RunConfig
from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.suffix import SuffixProposer
from specroll.engine.engine import Engine


def build_engine(config: RunConfig) -> tuple[Engine, DraftCounter | None]:
    """``Engine(config.generator.engine)``, with a proposer (and its draft counter) when speculating:
    the suffix proposer, or the EAGLE drafter of :meth:`RunConfig.served_drafter` (its K/V in
    ``drafter.kv_cache_gb``).

    Raises:
        CheckpointError, ValueError: the model cannot be loaded or a setting is out of range.
        DrafterError: the drafter directory holds no drafter, or one made for another model.
    """
    engine = config.generator.engine
    counter = None
    drafter = config.served_drafter()
    if config.speculative() == "suffix":
        counter = DraftCounter(SuffixProposer())
    elif drafter is not None:
        counter = DraftCounter(EagleProposer(drafter, kv_cache_memory_gb=config.drafter.kv_cache_gb,
                                             page_size=engine.page_size, seed=engine.seed))
    return Engine(engine, proposer=counter), counter
