"""The trainer's side of the retry rule (``specroll/rl/group_retries.py``): what happens when a group
it submitted is dropped whole — a single-turn group the hub dropped (its samples refused or lost past
``trainer.max_group_retries``) or an episode group whose episodes failed past it:

- none of its samples is trained, and it gives its place in the staleness window back
  (``Admission.on_drop``): it takes no place in any batch;
- its prompt is skipped until the next pass over the prompts, or served again next
  (``trainer.dropped_prompts``);
- it is logged, naming the group, the prompt and the last failure, and counted by reason for the
  next step's metrics line (``groups_dropped``: since the previous line, by reason;
  ``groups_dropped_total``: over this trainer's run) and for Prometheus (``specroll:groups_dropped``);
- more than 4·B groups dropped in a row, none finishing in between, end the run with exit code 2
  (refused, not restarted: a restart would fail the same way) — without it a generator refusing
  every chunk, or an environment failing every episode, would have groups submitted without end.
"""

from __future__ import annotations

import logging
from collections import Counter

from specroll.actors.config import RunConfig
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.setup import TrainerError
from specroll.rl.admission import Admission
from specroll.rl.group_retries import DropReason

log = logging.getLogger("specroll.trainer")


class GroupDrops:
    """The trainer's dropped groups (module docstring).

    Args:
        config: the run (``trainer.batch_groups``, ``trainer.dropped_prompts``).
        prompts: the prompt order (a retried prompt goes to its ``retry`` list, served first).
        admission: the feeder's staleness window.
        untrained: the feeder's groups submitted and not yet trained → their positions in the prompt order.
    """

    def __init__(self, config: RunConfig, prompts: PromptCycle, admission: Admission,
                 untrained: dict[str, int]) -> None:
        self.config, self.prompts, self.admission, self.untrained = config, prompts, admission, untrained
        self.total: Counter[DropReason] = Counter()
        """Groups dropped over this trainer's run, by reason."""
        self.not_in_hub: Counter[DropReason] = Counter()
        """Those the hub did not drop itself (episode groups): Prometheus adds them to the hub's count."""
        self._since_line: Counter[DropReason] = Counter()
        self.in_row = 0
        """Groups dropped since the last one that finished (or the last batch taken)."""
        self.gave_up = False

    @property
    def max_in_row(self) -> int:
        """Groups dropped in a row, none finishing, after which the run ends: 4·B."""
        return 4 * self.config.trainer.batch_groups

    def drop(self, group_id: str, prompt_id: str, reason: DropReason, detail: str, by_hub: bool) -> None:
        """``group_id`` (of prompt ``prompt_id``) was dropped: its last failure was ``reason`` (``detail``);
        ``by_hub``: the hub dropped it (and counts it in ``specroll:groups_dropped`` itself).

        Raises:
            TrainerError: more than :attr:`max_in_row` groups were dropped in a row (exit code 2).
        """
        position = self.untrained.pop(group_id, None)
        self.admission.on_drop()
        self.total[reason] += 1
        self._since_line[reason] += 1
        if not by_hub:
            self.not_in_hub[reason] += 1
        retry = self.config.trainer.dropped_prompts == "retry" and position is not None
        if retry:
            self.prompts.retry.append(position)  # type: ignore[arg-type]
        log.warning("group %s (prompt %s) dropped, none of it trained (%s: %s); its prompt is %s", group_id, prompt_id,
                    reason, detail, "served again next" if retry else "skipped until the next pass over the prompts")
        self.in_row += 1
        if self.in_row > self.max_in_row and not self.gave_up:
            self.gave_up = True  # once: groups dropping in the same tick must not each raise
            raise TrainerError(
                f"{self.in_row} groups in a row were dropped and none finished (the last: {reason}: {detail}); "
                "see the log's 'dropped' lines: a generator whose chunks are refused, generators that keep dying, "
                "or an environment whose every episode fails (task.*)", EXIT_REFUSED)

    def finished(self) -> None:
        """A group finished (or a batch was taken): the count in a row starts again."""
        self.in_row = 0

    def metrics(self) -> dict[str, object]:
        """The fields of the next metrics line: ``groups_dropped`` (since the previous line, by reason)
        and ``groups_dropped_total`` (over the run)."""
        since, self._since_line = dict(self._since_line), Counter()
        return {"groups_dropped": since, "groups_dropped_total": sum(self.total.values())}
