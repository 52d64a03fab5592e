"""What a step's metrics line says of its episodes (``task.environment``), and the views of a
batch's groups that single-turn groups and episode groups share."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from specroll.rl.coordinator import Group
from specroll.rl.episodes import EpisodeGroup

if TYPE_CHECKING:
    from specroll.actors.trainer.episodes import EpisodeFeeder


def token_versions(group: Group | EpisodeGroup) -> Iterator[int]:
    """The policy version of every token the policy produced in ``group``."""
    if isinstance(group, Group):
        return (v for s in group.samples for v in s.versions)
    return (v for e in group.episodes for t in e.turns for v in t.versions)


def response_lengths(group: Group | EpisodeGroup) -> list[int]:
    """Tokens the policy produced per sample (per episode: over its turns)."""
    if isinstance(group, Group):
        return [len(s.token_ids) for s in group.samples]
    return [sum(len(t.token_ids) for t in e.turns) for e in group.episodes]


def episode_metrics(groups: Sequence[EpisodeGroup], feeder: EpisodeFeeder) -> dict[str, object]:
    """The episode fields of a step's metrics line: per episode, the means of its turns, tool calls
    parsed and failed to parse, sequences it trained as (1 when every turn's prompt extended the
    previous turn's tokens), tokens (the policy's and the environment's), seconds, and each figure
    the environment reported (``env_<name>``); the retries, failures by reason, and the server's
    stitching outcomes so far (the groups dropped are in every metrics line: ``group_drops.py``)."""
    episodes = [e for g in groups for e in g.episodes]
    count = max(len(episodes), 1)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / count

    segments = [e.segments for e in episodes]
    out: dict[str, object] = {
        "episodes": len(episodes),
        "turns_mean": mean([len(e.turns) for e in episodes]),
        "tool_calls_mean": mean([sum(t.tool_calls for t in e.turns) for e in episodes]),
        "tool_call_errors_mean": mean([sum(t.tool_call_errors for t in e.turns) for e in episodes]),
        "tool_call_errors": sum(t.tool_call_errors for e in episodes for t in e.turns),
        "sequences_mean": mean([len(s) for s in segments]),
        "episode_tokens_mean": mean([sum(len(x.token_ids) for x in s) for s in segments]),
        "episode_s_mean": mean([e.seconds for e in episodes]),
        "episode_retries": sum(g.retries for g in groups),
        "episode_failures": dict(feeder.runner.failures),
        "stitch": dict(feeder.runner.server.router.transcripts.outcomes),
    }
    names = sorted({k for e in episodes for k in e.metrics})
    for name in names:
        out[f"env_{name}_mean"] = mean([e.metrics.get(name, 0.0) for e in episodes])
    return out
