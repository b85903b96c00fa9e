"""A commit's two halves.

On the training thread (:func:`capture`), once the scheduler and scaler have stepped:
rank 0's state for the restore (param groups, scheduler, scaler) and the model state
outside the optimizer that changed are copied to the host non-blocking; nothing waits.

On the sender thread (:func:`build`), in queue order: wait for those copies and the
step's (the recorder's :class:`~trainer_hooks.session.recorder.Commit`), check the probed
gradients against what was staged, fill in the replay record (clip, GradScaler factors,
a step skipped on the device) and frame the commit per worker. A failed check refuses
the commit (:class:`~trainer_hooks.session.items.Refused`): nothing of it is sent.
"""

from __future__ import annotations

from typing import Any

import msgpack

from shadow.core.errors import ShadowError, ShadowUsageError
from shadow.export import blob as _codec
from trainer_hooks.session import audit, checks, transfer
from trainer_hooks.session.items import Refused
from trainer_hooks.session.recorder import Commit
from trainer_hooks.session.transfer import HostCopy


def capture(att, commit: Commit) -> tuple[HostCopy | None, Any]:
    """Training thread: ``(rank 0's state, pending extras)`` of ``commit``, copying. Under
    pipeline stages every rank's param groups and scheduler travel (its stage's), the
    model state outside the optimizer rank 0's only."""
    if att.target.rank != 0 and att.target.stages is None:
        return None, None
    sched, scaler = att.options.scheduler, att.options.scaler
    state = HostCopy(
        {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in att.target.optimizer.param_groups],
            "scheduler": sched.state_dict() if sched is not None else None,
            "scaler": transfer.scaler_state(scaler),
        }
    )
    return state, att.capture_extras(bool(commit.replay["bootstrap"])) if att.target.rank == 0 else None


def _resolve(commit: Commit, probed: dict, layout) -> dict:
    """The replay record of ``commit`` with what the step left on the device."""
    replay = dict(commit.replay)
    if commit.refusal is not None:
        raise Refused(commit.refusal) from ShadowUsageError(
            f"{commit.refusal}; nothing from this iteration was checkpointed"
        )
    if commit.late is None:  # a bootstrap: nothing was read on the device
        return replay
    late = commit.late.get()
    s = late["scalars"]
    replay.update(
        clip=s["clip"],
        inv_scale=s["inv_scale"],
        grad_scale=s["grad_scale"],
        skip_step=bool(replay["skip_step"] or (s["found_inf"] is not None and s["found_inf"] != 0.0)),
    )
    if commit.probes is not None:
        kept, grads = commit.probes
        factors = [f for f in (s["inv_scale"], s["clip"]) if f is not None]
        try:
            checks.check_samples(kept, grads.get().numpy(), probed, factors, layout, commit.iteration)
        except ShadowError as exc:
            raise Refused(str(exc)) from exc
    if commit.audit is not None:
        replay["audit_values"] = audit.values(commit.audit, late["audit"])
    return replay


def build(att, commit: Commit, state: HostCopy | None, extras: Any, probed: dict) -> tuple[list, list]:
    """Sender thread: ``(EXTRA items to send first, commit body per worker)``."""
    k, target, workers = commit.iteration, att.target, att.handshake.workers
    replay = _resolve(commit, probed, target.layout)
    if target.stages is not None:  # a pipeline stage's record, in the whole model's terms
        replay = target.stages.globalize(replay)
    audits = replay.pop("audit_values", None)
    extra = commit.extra.get() if isinstance(commit.extra, HostCopy) else commit.extra
    blob_obj: dict = {"rank": target.rank, "world": target.world, "rng": commit.rng, "extra_state": extra}
    if state is not None:
        blob_obj.update(state.get())
        blob_obj["aliases"] = target.aliases
        if target.stages is not None:  # its param groups are the whole model's from this index on
            blob_obj["groups_at"] = target.stages.group0
    try:
        blob = _codec.pack(blob_obj)
    except _codec.EncodeError as exc:
        err = ShadowError(f"cannot record iteration {k}: {exc} (check what extra_state returns)")
        raise Refused(str(err)) from err
    items, counts = extras.finish(k) if extras is not None else ([], None)
    nshards = max(w.get("shard", i) for i, w in enumerate(workers)) + 1
    bodies = []
    for w in range(len(att.handshake.shards)):
        owner = workers[w].get("shard", w) == target.rank % nshards  # every replica of that shard
        rec = dict(replay, sent=commit.sent[w])
        if commit.kept is not None and commit.kept[w]:
            rec["kept"] = commit.kept[w]  # the state the worker kept, proved instead of sent
        if counts is not None and counts[w]:
            rec["extras"] = counts[w]  # EXTRA chunks sent ahead of this commit
        if audits is not None and audits[w] is not None:
            rec["audit"] = audits[w]
        bodies.append(msgpack.packb({"replay": rec, "blob": blob if owner else None}, use_bin_type=True))
    return items, bodies
