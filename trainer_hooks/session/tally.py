"""What a session counts across its attachments (resyncs and re-attaches included): the
figures of the attachments it closed, the steps taken while streaming nothing (warned
about every ``tuning.unprotected_warn_iterations`` steps), and :meth:`Session.stats`'s
figures built from them and the current attachment's."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class Tally:
    """One session's running totals. The session tells it when an attachment closes
    (:meth:`add`) and after every optimizer step (:meth:`step`)."""

    def __init__(self, first_base: int, rank: int, warn_every: int) -> None:
        """Totals from iteration ``first_base`` (where the session first attached) on, for
        ``rank``; an unprotected stretch is warned about every ``warn_every`` steps (0: never)."""
        self.first_base, self.rank, self.warn_every = first_base, rank, warn_every
        self.past: dict[str, float] = {
            "hook_s": 0.0,
            "buckets": 0,
            "blocked_s": 0.0,
            "bytes_out": 0,
            "messages_out": 0,
        }  # figures of closed attachments
        self.unprotected = 0  # steps in a row taken while not streaming (0 while protected)
        self.unprotected_total = 0  # all such steps since attach
        self.unprotected_since = -1  # the iteration the current unprotected stretch began after

    def add(self, figures: dict[str, Any]) -> None:
        """A closed attachment's :meth:`~trainer_hooks.session.attachment.Attachment.figures`,
        added to the totals."""
        for key, value in figures.items():
            if key in self.past:
                self.past[key] += value

    def step(self, why: str | None, iteration: int, committed: int) -> None:
        """A step was taken; ``why``: why this rank streams nothing now (None while it does).
        A step taken so is counted and warned about again every ``warn_every`` steps, never
        just once: a run that lost its protection keeps saying so until it has it back."""
        if why is None:
            self.unprotected = 0
            return
        if self.unprotected == 0:
            self.unprotected_since = iteration
        self.unprotected += 1
        self.unprotected_total += 1
        every = self.warn_every
        if every and self.unprotected % every == 0:
            logger.warning(
                "rank %d: still training WITHOUT new checkpoints: %d steps since iteration %d (the newest "
                "checkpoint is iteration %d); %s",
                self.rank,
                self.unprotected,
                self.unprotected_since,
                committed,
                why,
            )

    def stats(
        self,
        figures: dict[str, Any],
        live: bool,
        *,
        iteration: int,
        degraded: str | None,
        committed: int,
        base_kept: bool,
        shadow_errors: int,
    ) -> dict[str, Any]:
        """The session's figures: the totals plus the current attachment's ``figures``
        (counted only while ``live``: a closed attachment's are in the totals already), and
        the session's state as it stands now."""

        def total(key: str) -> float:
            return self.past[key] + (figures[key] if live else 0)

        hook_s, buckets = total("hook_s"), total("buckets")
        return {
            "hook_s": hook_s,
            "buckets": buckets,
            "hook_s_per_bucket": hook_s / buckets if buckets else 0.0,
            "steps": iteration - self.first_base,
            "blocked_s": total("blocked_s"),
            "ring_occupancy": figures["occupancy"],
            "ring_high_water": figures["high_water"],
            "degraded": degraded,
            "unprotected_steps": self.unprotected,
            "unprotected_steps_total": self.unprotected_total,
            "bytes_out": total("bytes_out"),
            "messages_out": total("messages_out"),
            "committed": committed,
            "iteration": iteration,
            "base_kept": base_kept,
            "shadow_errors": shadow_errors,
        }
