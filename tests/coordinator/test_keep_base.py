"""An attach after a restore from the cluster's own memory keeps the workers' state as the
new epoch's base instead of taking it again from the ranks (issue 52: the re-attach was most
of what a recovery cost beyond the restore). The coordinator offers it (``configure``'s
``keep``) only where the memory holds exactly the ranks' start iteration of the same job,
layout, world and optimizer, never diverged, and every rank claims that restore; the ranks
hear ``keep`` only when every worker kept it.

Units: the coordinator driven through ``on_message`` with a recording outbox."""

from __future__ import annotations

import pytest

from tests.coordinator.test_coordinator_parts import LAYOUT, OPTIM, Sim


def _claim(iteration: int = 0, generation: int = 0, tier: str = "memory") -> dict:
    return {"iteration": iteration, "job": "job", "generation": generation, "tier": tier, "source": "tcp://x"}


def _reattach(sim: Sim, iteration: int = 0, restored: dict | None = None, optim: dict = OPTIM, **extra) -> None:
    """The job's first run detached; a new run's rank 0 attaches (world 1)."""
    sim.send(b"t0", "detach", epoch=1, rank=0)
    sim.out.clear()
    sim.send(
        b"n0",
        "attach",
        job="job",
        rank=0,
        world=1,
        layout_hash=LAYOUT.hash,
        layout=LAYOUT.to_dict(),
        optim=optim,
        iteration=iteration,
        overwrite=False,
        restored=_claim(iteration) if restored is None else restored,
        **extra,
    )


def _offered(sim: Sim) -> list:
    return [sim.out.last("configure", b"w%d" % i).get("keep") for i in range(2)]


def test_a_restore_from_memory_is_kept_when_every_worker_kept_it():
    sim = Sim()
    sim.running()
    _reattach(sim, keep=True)
    assert sim.state.epoch == 2
    assert _offered(sim) == [1, 1]  # epoch 1's state at iteration 0
    for i in range(2):
        sim.send(b"w%d" % i, "configured", epoch=2, kept=True)
    assert sim.out.last("attached", b"n0")["keep"] is True


def test_the_ranks_send_the_state_when_one_worker_did_not_keep_it():
    sim = Sim()
    sim.running()
    _reattach(sim, keep=True)
    sim.send(b"w0", "configured", epoch=2, kept=True)
    sim.send(b"w1", "configured", epoch=2)  # e.g. a worker restarted since: nothing to keep
    assert "keep" not in sim.out.last("attached", b"n0")


@pytest.mark.parametrize(
    "why, restored, extra",
    [
        ("a trainer that cannot prove its state", None, {}),
        ("a restore from a tier", _claim(tier="local"), {"keep": True}),
        ("a claim of another generation", _claim(generation=1), {"keep": True}),
        ("no restore at all", {}, {"keep": True}),
        ("a resync of the job's own ranks", None, {"keep": True, "owner": {"epoch": 1, "token": b"x" * 16}}),
    ],
)
def test_no_keep_is_offered_for(why, restored, extra):
    sim = Sim()
    sim.running()
    _reattach(sim, restored=restored, **extra)
    assert sim.state.epoch == 2, why
    assert _offered(sim) == [None, None], why


def test_no_keep_for_another_optimizer_or_iteration_than_the_memory_holds():
    sim = Sim()
    sim.running()
    _reattach(sim, optim={**OPTIM, "impl": "other"}, keep=True)
    assert _offered(sim) == [None, None]
    sim = Sim()
    sim.running()
    sim.prepared(b"w0", 1)
    sim.prepared(b"w1", 1)
    assert sim.state.job is not None and sim.state.job.cut == 1
    _reattach(sim, iteration=1, restored=_claim(1), keep=True)
    assert _offered(sim) == [1, 1]
    sim = Sim()
    sim.running()
    sim.state.job.diverged = 0  # type: ignore[union-attr]  # an audit found the workers' state wrong
    _reattach(sim, keep=True)
    assert _offered(sim) == [None, None]
