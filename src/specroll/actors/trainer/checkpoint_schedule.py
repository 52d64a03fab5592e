"""When the trainer writes a checkpoint, and what a full disk does to one.

A checkpoint is due every ``trainer.checkpoint_every`` steps and after the last step (the final one).
A checkpoint that a full disk stops (``OSError`` with an errno in ``sealed.OUT_OF_SPACE``: ENOSPC,
EDQUOT, EFBIG) leaves no trace (``checkpoint.py``: the checkpoints before it stay as they were):

* before the last step the run goes on — a long RL run would rather keep training and try again at
  the next checkpoint than stop — with one warning line, which the next metrics line also carries
  as ``checkpoint_warning`` (``specroll launch`` prints it);
* the final checkpoint ends the trainer with an error (exit 1) naming the last good checkpoint: the
  trained weights would otherwise be lost without a word (``specroll launch`` restarts it within
  ``launch.max_restarts``, resuming from that checkpoint).

A checkpoint the file system refuses for good (EACCES, EPERM, EROFS: :data:`NOT_ALLOWED` — a
read-only or immutable folder) ends the trainer at once with one line naming the file, as a refusal
(exit 2, which ``specroll launch`` does not restart: every try would fail the same). Any other
``OSError`` (an I/O error) ends the run as before.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from specroll.actors.config import RunConfig
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.setup import TrainerError
from specroll.engine.loaders.sealed import OUT_OF_SPACE

log = logging.getLogger("specroll.trainer")

NOT_ALLOWED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
"""``OSError.errno`` values of a write the file system refuses for good."""


class CheckpointSchedule:
    """The trainer's checkpoints: which steps get one, the last one written, the pending warning.

    Args:
        config: the run (``trainer.checkpoint_every``, 0: only the final one; ``steps``, the total).
        step: the step the trainer starts at (a resumed one: its checkpoint's).
        resumed_from: the checkpoint it resumed from, or None.
        refused: why each newer checkpoint was passed over (``TrainerSetup.refused``): the first
            metrics line carries it as ``checkpoint_warning``, so ``specroll launch`` prints it.
    """

    def __init__(self, config: RunConfig, step: int, resumed_from: Path | None, refused: Sequence[str] = ()) -> None:
        self.every, self.steps = config.trainer.checkpoint_every, config.steps
        self.last_step = step
        """Step of the newest checkpoint written or resumed from (the starting step without one)."""
        self.last_path = resumed_from
        """That checkpoint's folder; None while there is none."""
        self.warning: str | None = (f"resumed from {resumed_from} (step {step}): refused {'; '.join(refused)}"
                                    if refused and resumed_from is not None else None)
        """The line of a checkpoint a full disk stopped (or, at first, of the newer checkpoints the resume
        passed over: the launcher checks their sizes only), until :meth:`add_warning` takes it."""

    def due(self, step: int) -> bool:
        """Whether ``step`` (just trained, before the last) gets a checkpoint; the last step's is
        the final one (:meth:`final_due`)."""
        return bool(self.every) and step % self.every == 0 and step < self.steps

    def final_due(self, step: int) -> bool:
        """Whether the run, ending at ``step``, still needs its final checkpoint."""
        return self.last_step != step

    def write(self, save: Callable[[Path, TrainerState], Path], run_dir: Path, state: TrainerState,
              final: bool = False) -> None:
        """Write the checkpoint of ``state`` with ``save`` (``Policy.save``; blocking: call it in a
        worker thread) and log one line; a full disk is the module docstring's.

        Raises:
            TrainerError: a full disk stopped the final checkpoint (exit 1); the file system refused
                it (:data:`NOT_ALLOWED`, exit 2).
            OSError: any other failure to write it.
        """
        try:
            path = save(run_dir, state)
        except OSError as e:
            line = self.failed(e, state.step, final)
            if final:
                raise TrainerError(line) from None
            log.warning("%s", line)
            return
        self.last_step, self.last_path = state.step, path
        log.info("checkpoint of step %d (policy version %d) written to %s", state.step, state.policy_version, path)

    def failed(self, error: OSError, step: int, final: bool) -> str:
        """The one line for the checkpoint of ``step`` that ``error`` stopped; kept as the pending
        warning unless ``final``.

        Raises:
            TrainerError: the file system refused it (:data:`NOT_ALLOWED`; exit 2).
            OSError: ``error`` itself, unless it is a full disk.
        """
        last = (f"a resume starts from step {self.last_step} ({self.last_path})" if self.last_path is not None
                else "no checkpoint was written yet: a resume starts from step 0")
        if error.errno in NOT_ALLOWED:
            raise TrainerError(f"the checkpoint of step {step} cannot be written: {error.filename or ''}: "
                               f"{error.strerror} (expected a writable run directory); {last}; make it "
                               "writable and launch again", EXIT_REFUSED) from error
        if error.errno not in OUT_OF_SPACE:
            raise error
        where = f"{Path(error.filename).name}: " if error.filename else ""
        if final:
            return (f"the final checkpoint of step {step} was not written ({where}{error.strerror}); {last}; free "
                    "space and launch again to train the steps after it")
        self.warning = (f"checkpoint of step {step} not written ({where}{error.strerror}); training goes on, {last}, "
                        f"next try at step {step + self.every}")
        return self.warning

    def add_warning(self, record: dict[str, object]) -> None:
        """Put the pending warning, if any, into the metrics ``record`` as ``checkpoint_warning`` (once)."""
        if self.warning is not None:
            record["checkpoint_warning"], self.warning = self.warning, None
