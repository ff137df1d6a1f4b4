"""A diverged run: the streak of non-finite steps, the one line each logs, and the NonFinite that ends the
run. The loop counts each step here; the checkpointer refuses to write non-finite weights with the same
exception (trainer.train classifies it: exit 1, not retried, since a restart would diverge again)."""

from __future__ import annotations

from supernode.core.observability import TrainerLine

from .log import LOG


class NonFinite(Exception):
    """Training diverged: the loss or gradient norm stayed non-finite (not retryable: it would again)."""


class Divergence:
    """The run's non-finite steps (loss or gradient norm NaN/Inf: the update skipped): the streak,
    the line each skipped step logs, and the NonFinite that ends the run, at a streak of
    training.maxNonFiniteSteps or when the run ends inside a streak (its weights are an earlier step's)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def count(self, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """Count this step; a skipped one says so."""
        if not skipped:
            self.streak = 0
            return
        self.streak += 1
        LOG.info(
            f"step {step}: loss {loss}, grad norm {grad_norm}: {TrainerLine.SKIPPED} "
            f"({self.streak} in a row of at most {self.limit})"
        )

    def skipped(self, step: int) -> str:
        return f"step {step}" if self.streak == 1 else f"steps {step - self.streak + 1}-{step}"

    @staticmethod
    def kept(last_saved: int) -> str:
        return (
            f"the checkpoint of step {last_saved} holds the last trained state"
            if last_saved
            else "no checkpoint was written"
        )

    def check(self, step: int, last_saved: int, last: bool) -> None:
        """Raise NonFinite where the run must end (a save in flight is of an earlier, finite step: kept)."""
        if self.streak >= self.limit:
            raise NonFinite(
                f"training diverged: loss or gradient norm not finite for {self.streak} consecutive steps "
                f"({self.skipped(step)}, updates skipped); stopped without a checkpoint. "
                f"{'The checkpoint of step ' + str(last_saved) + ' holds the last finite state' if last_saved else 'No checkpoint was written'}; "  # noqa: E501
                "lower training.lr or raise training.warmupSteps, then run again"
            )
        if self.streak and last:  # the run did not train through its last steps: not a success
            raise NonFinite(
                f"training ended on non-finite steps: loss or gradient norm not finite at {self.skipped(step)} "
                f"(updates skipped), so the weights are still those of step {step - self.streak}; no "
                f"checkpoint of step {step} written ({self.kept(last_saved)}). Lower training.lr or raise "
                "training.warmupSteps, then run again"
            )
