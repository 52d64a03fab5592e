"""Episodes stitched into the sequences the generators saw, and packed for training: the trained
tokens are exactly the model's, the environment's are in the sequence and out of the loss, a turn
whose prompt does not extend the sequence starts one of its own, and every sequence carries its
episode's advantage."""

from __future__ import annotations

import pytest
import torch

from specroll.rl.episodes import Episode, EpisodeGroup, Turn, pack_episode_groups, stitch


def _turn(prompt: list[int], completion: list[int], version: int = 0) -> Turn:
    return Turn(prompt, completion, [-0.5 - 0.01 * t for t in completion], [version] * len(completion))


def _episode_turns(k: int, start: int = 10) -> list[Turn]:
    """k turns whose prompts each extend the last sequence by 3 environment tokens."""
    turns, prompt = [], [1, 2, 3]
    for i in range(k):
        completion = [start + 10 * i + j for j in range(2 + i)]
        turns.append(_turn(prompt, completion, version=i))
        prompt = prompt + completion + [90 + i, 91 + i, 92 + i]
    return turns


@pytest.mark.parametrize("k", [2, 4])
def test_turns_that_extend_each_other_are_one_sequence_with_the_environment_masked(k):
    turns = _episode_turns(k)
    [segment] = stitch(turns)
    assert segment.prompt_token_ids == turns[0].prompt_token_ids
    # the sequence is exactly the last turn's prompt and completion
    assert segment.prompt_token_ids + segment.token_ids == turns[-1].prompt_token_ids + turns[-1].token_ids
    trained = [t for t, keep in zip(segment.token_ids, segment.trained, strict=True) if keep]
    assert trained == [t for turn in turns for t in turn.token_ids]
    environment = [t for t, keep in zip(segment.token_ids, segment.trained, strict=True) if not keep]
    assert environment == [t for i in range(k - 1) for t in (90 + i, 91 + i, 92 + i)]
    versions = [v for v, keep in zip(segment.versions, segment.trained, strict=True) if keep]
    assert versions == [v for turn in turns for v in turn.versions]


def test_a_turn_whose_prompt_does_not_extend_the_sequence_starts_its_own():
    first = _turn([1, 2, 3], [10, 11])
    rewritten = _turn([1, 2, 3, 10, 99, 5], [20, 21])  # the history was re-rendered: 11 became 99
    after = _turn([1, 2, 3, 10, 99, 5, 20, 21, 7], [30])
    segments = stitch([first, rewritten, after])
    assert [s.prompt_token_ids for s in segments] == [[1, 2, 3], [1, 2, 3, 10, 99, 5]]
    assert segments[1].token_ids == [20, 21, 7, 30] and segments[1].trained == [True, True, False, True]
    assert stitch([_turn([1], [2]), _turn([1, 2], [3])])[0].trained == [True, True]  # no environment tokens


def test_malformed_turns_are_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        stitch([_turn([], [1])])
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        stitch([Turn([1], [2, 3], [0.0], [0, 0])])


def test_packing_trains_model_tokens_only_each_sequence_with_its_episodes_advantage():
    two = [_episode_turns(2), _episode_turns(2, start=40)]
    split = [_turn([1, 2, 3], [10, 11]), _turn([5, 5, 5], [12])]  # two sequences of its own
    group = EpisodeGroup("g0", None, [Episode(t, reward) for t, reward in
                                      ((two[0], 1.0), (two[1], 0.0), (split, 1.0), (_episode_turns(4), 0.0))])
    rewards, batch = pack_episode_groups([group], normalize_std=True, fill_version=7)
    assert rewards.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    # one row for the shared prompt [1, 2, 3] (four sequences), one for [5, 5, 5]
    assert batch.input_ids.shape[0] == 2 and batch.row_starts.tolist() == [0, 4, 5]
    model_tokens = [t for e in group.episodes for turn in e.turns for t in turn.token_ids]
    assert sorted(batch.targets[batch.loss_mask].tolist()) == sorted(model_tokens)
    assert int(batch.loss_mask.sum()) == len(model_tokens)
    environment = {90, 91, 92, 93, 94, 95}
    in_mask = set(batch.targets[batch.loss_mask].tolist())
    assert not in_mask & environment and environment & set(batch.input_ids.flatten().tolist())
    assert (batch.versions[~batch.loss_mask] == 7).all()
    advantages = batch.advantages.tolist()
    assert advantages[0] > 0 > advantages[1] and advantages[2] == advantages[4] > 0  # split episode: both sequences
    assert advantages[3] < 0


def test_groups_must_be_whole_and_episodes_non_empty():
    with pytest.raises(ValueError, match="no turn"):
        pack_episode_groups([EpisodeGroup("g", None, [Episode([], 1.0)])], normalize_std=True, fill_version=0)
    one, two = (EpisodeGroup(f"g{i}", None, [Episode(_episode_turns(2), 1.0)] * i) for i in (1, 2))
    with pytest.raises(ValueError, match="equal, non-zero size"):
        pack_episode_groups([one, two], normalize_std=True, fill_version=0)
    assert torch.equal(pack_episode_groups([two], normalize_std=False, fill_version=0)[1].advantages,
                       torch.zeros(2))  # equal rewards: no signal
