"""A generator's live samples (``actors/generator/live_samples.py``) on a real tiny engine, in-process:
what a generator that registers again does with the groups it held (the process-level test is
``test_generator_actor.py::test_registering_again_drops_the_live_groups_so_the_trainer_can_resume_them_here``)."""

from __future__ import annotations

from pathlib import Path

from specroll.actors.generator.drafter_swap import DrafterSlot
from specroll.actors.generator.live_samples import LiveSamples
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.messages import RolloutChunk, SubmitGroup
from specroll.protocol.sampling import SamplingParams

PROMPT = [5, 17, 42, 9, 77, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def live(model: Path) -> tuple[LiveSamples, list[RolloutChunk]]:
    """Live samples on a fresh engine of ``model``, and the chunks they send."""
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.02))
    chunks: list[RolloutChunk] = []
    return LiveSamples(engine, DrafterSlot(engine, None), chunks.append, stream_every=1, speculative=False), chunks


def serve(samples: LiveSamples) -> None:
    """Step the engine until it holds nothing, handing each step's outputs to ``samples``."""
    while samples.engine.has_unfinished():
        samples.on_outputs(samples.engine.step())


def test_a_group_resubmitted_before_the_inbox_pass_ends_replaces_the_abandoned_copy(tiny_llama: Path) -> None:
    """``abandon`` can run while the generator awaits inside its inbox pass (a weight update in a
    thread), and the same group can arrive again from the trainer in that pass: its samples reuse the
    abandoned ones' request ids. The submit must end those engine requests first, not be refused as
    "already live" (one more failure counted against the group), and only the new copy streams."""
    samples, chunks = live(tiny_llama)
    engine = samples.engine
    engine.add_request(PROMPT, GREEDY, "ref")
    expected = run_to_completion(engine)["ref"].token_ids
    group = SubmitGroup(group_id="g", prompt_token_ids=PROMPT, n=2, sampling=GREEDY)
    samples.submit(group)
    for _ in range(3):
        samples.on_outputs(engine.step())
    old_chunks = len(chunks)
    assert old_chunks > 0 and not any(c.finished for c in chunks)

    assert samples.abandon() == 1
    samples.submit(group)  # no drop_abandoned() between: the inbox pass had already begun
    serve(samples)

    new = chunks[old_chunks:]
    for i in (0, 1):
        mine = [c for c in new if c.sample_index == i]
        assert mine[0].offset == 0, "the new copy starts over; no chunk of the old copy follows abandon()"
        assert [t for c in mine for t in c.token_ids] == expected
        assert mine[-1].finish_reason == "length"
    assert samples.streams == {} and samples.groups == {} and not engine.has_unfinished()


def test_outputs_of_a_step_that_ran_during_abandon_are_ignored(tiny_llama: Path) -> None:
    """A step running in its thread while ``abandon`` forgets the samples hands back their outputs:
    they make no chunk, and the engine requests end at the next inbox pass."""
    samples, chunks = live(tiny_llama)
    engine = samples.engine
    samples.submit(SubmitGroup(group_id="g", prompt_token_ids=PROMPT, n=2, sampling=GREEDY))
    samples.on_outputs(engine.step())
    sent = len(chunks)
    outputs = engine.step()  # "in the thread" when abandon() runs
    assert samples.abandon() == 1
    samples.on_outputs(outputs)
    assert len(chunks) == sent
    assert engine.has_unfinished()
    samples.drop_abandoned()
    assert not engine.has_unfinished()
