"""Tensor parallelism, alone and under FSDP2 (torchtitan's 2D), checkpointed every iteration
(issue 55), on CPU with gloo against a real cluster. The model (``tests.helpers.parallel``)
is sharded as torchtitan shards a Llama: a row-wise embedding (``Shard(0)``, its gradient
``Replicate()``), sequence-parallel norms (``Replicate()``, gradients ``Partial()``), a
column- then row-wise MLP (``Shard(0)``, ``Shard(1)``: a rank's piece of the second is one
run per row in the flat space) and a column-wise output, with uneven sizes (33 rows on 2
ranks: 17 + 16; 70 rows on (dp 2, tp 2): ``(_StridedShard(0, sf=2), Shard(0))``, 18 + 17
twice). Accumulation over two micro-batches and a clip over the whole model throughout.

What is checked, with ``torch.equal`` on every parameter and moment: each rank's local
tensors are the boxes of the full tensors the shadow computes; the shadow's newest
iteration equals the full state of the run; ranks killed with SIGKILL restore it, resume,
and end where an uninterrupted run ends, losses bit for bit; a 2x2 checkpoint restores onto
4x1 and onto one plain process, its DCP export loads into a 4x1 model through torch's
own state-dict API, and the 4x1 run trains on attached."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from shadow.config.tuning import Tuning
from shadow.testing import LocalCluster, free_port
from tests.helpers import parallel as P
from tests.slow.test_fsdp import _done, _equal, _snapshot_state, _spawn

pytestmark = pytest.mark.slow

STEPS_BEFORE_KILL = 4
STEPS = 6


def _dp_rank(mesh) -> int:
    return mesh["dp"].get_local_rank()


def _check_boxes(m) -> None:
    """Each rank's local tensors are the boxes of the unsharded model's that the shadow
    computes from the placements (an independent check of ``placement.box``)."""
    from trainer_hooks.capture import placement

    ref = dict(P.plain().named_parameters())
    for n, p in m.named_parameters():
        assert torch.equal(p.to_local(), placement.take(ref[n].detach(), placement.box_of(p))), n


def _uninterrupted(rank: int, world: int, port: int, out: str, shape, impl: str) -> None:
    mesh = P.init(rank, world, port, shape)
    m = P.sharded(mesh, dp=shape[0] > 1)
    opt = P.optimizer(m, impl)
    losses = [P.step(m, opt, it, _dp_rank(mesh)) for it in range(1, STEPS + 1)]
    state = P.full(m, opt)
    if rank == 0:
        torch.save({"state": state, "losses": losses}, out)
    _done()


def _trained(rank: int, world: int, port: int, address: str, out: str, shape, impl: str) -> None:
    import trainer_hooks

    mesh = P.init(rank, world, port, shape)
    m = P.sharded(mesh, dp=shape[0] > 1)
    _check_boxes(m)
    opt = P.optimizer(m, impl)
    # at most 8 runs per message: the row-wise matrix's rows (a run each) go out in several
    trainer_hooks.attach(m, opt, address, job="tp", tuning=Tuning(max_runs=8))
    for it in range(1, STEPS_BEFORE_KILL + 1):
        P.step(m, opt, it, _dp_rank(mesh))
        state = P.full(m, opt)
        if rank == 0:
            torch.save(state, f"{out}.{it}")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _resumed(rank: int, world: int, port: int, address: str, out: str, shape, impl: str) -> None:
    import trainer_hooks

    mesh = P.init(rank, world, port, shape)
    m = P.sharded(mesh, dp=shape[0] > 1)
    opt = P.optimizer(m, impl)
    info = trainer_hooks.restore(m, opt, address, job="tp")
    restored = P.full(m, opt)
    session = trainer_hooks.attach(m, opt, address, job="tp")
    losses = [P.step(m, opt, it, _dp_rank(mesh)) for it in range(info.iteration + 1, STEPS + 1)]
    committed = session.close()
    state = P.full(m, opt)
    if rank == 0:
        torch.save(
            {
                "iteration": info.iteration,
                "restored": restored,
                "losses": losses,
                "committed": committed,
                "state": state,
                "stats": session.stats(),
            },
            out,
        )
    _done()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_tensor_parallel_killed_restored_and_resumed_bit_for_bit(tmp_path, impl):
    shape, world = (1, 2), 2
    out = str(tmp_path / "state")
    _spawn(_uninterrupted, world, free_port(), f"{out}.uninterrupted", shape, impl)
    end = torch.load(f"{out}.uninterrupted")
    with LocalCluster(tmp_path, workers=2) as cl:
        _spawn(_trained, world, free_port(), cl.address, out, shape, impl, killed=True)
        it, shadow = _snapshot_state(cl.address, "tp")
        assert 1 <= it <= STEPS_BEFORE_KILL, it
        _equal(shadow, torch.load(f"{out}.{it}"), f"the shadow's iteration {it}")

        _spawn(_resumed, world, free_port(), cl.address, f"{out}.resumed", shape, impl)
        resumed = torch.load(f"{out}.resumed")
        assert resumed["iteration"] == it
        _equal(resumed["restored"], torch.load(f"{out}.{it}"), f"restored iteration {it}")
        assert resumed["committed"] == STEPS
        _equal(resumed["state"], end["state"], "the resumed run's end")
        assert resumed["losses"] == end["losses"][it:], "losses after the restore"
        last, shadow = _snapshot_state(cl.address, "tp")
        assert last == STEPS
        _equal(shadow, end["state"], "the shadow's last iteration")
        # each rank streams its boxes, the replicated ones (norms, a bias) striped between
        # the two: under the model's bytes per step (+3 bootstrap fields)
        total = sum(v.numel() for k, v in end["state"].items() if "/" not in k)
        assert resumed["stats"]["bytes_out"] < 4 * total * (STEPS - it + 3), resumed["stats"]


def _two_by_two(rank: int, world: int, port: int, address: str, out: str) -> None:
    """FSDP2 x TP on (dp 2, tp 2): attached, the full state after every step."""
    import trainer_hooks

    mesh = P.init(rank, world, port, (2, 2))
    m = P.sharded(mesh, dp=True)
    _check_boxes(m)
    opt = P.optimizer(m, "foreach")
    session = trainer_hooks.attach(m, opt, address, job="tp")
    for it in range(1, 4):
        P.step(m, opt, it, _dp_rank(mesh))
        state = P.full(m, opt)
        if rank == 0:
            torch.save(state, f"{out}.{it}")
    committed = session.close()
    if rank == 0:
        torch.save({"committed": committed, "stats": session.stats()}, f"{out}.end")
    _done()


def _onto(rank: int, world: int, port: int, address: str, out: str, shape, dcp_dir: str = "") -> None:
    """Restore the 2x2 job onto a ``shape`` mesh (or, on one rank with ``shape`` None, a
    plain model); (sharded) load its DCP export into another model of that mesh through
    torch's own state-dict API, then train on attached for two steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import trainer_hooks

    if shape is None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        m = P.plain()
        opt = P.optimizer(m, "foreach")
        info = trainer_hooks.restore(m, opt, address, job="tp")
        torch.save({"iteration": info.iteration, "restored": P.full(m, opt)}, out)
        _done()
    mesh = P.init(rank, world, port, shape)
    m = P.sharded(mesh, dp=True)
    opt = P.optimizer(m, "foreach")
    info = trainer_hooks.restore(m, opt, address, job="tp")
    restored = P.full(m, opt)
    m2 = P.sharded(mesh, dp=True)
    opt2 = P.optimizer(m2, "foreach")
    model_sd, optim_sd = get_state_dict(m2, opt2)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded = P.full(m2, opt2)
    session = trainer_hooks.attach(m, opt, address, job="tp")
    for it in range(info.iteration + 1, info.iteration + 3):
        P.step(m, opt, it, _dp_rank(mesh))
    committed = session.close()
    on = P.full(m, opt)
    if rank == 0:
        torch.save(
            {"iteration": info.iteration, "restored": restored, "dcp": loaded, "committed": committed, "on": on}, out
        )
    _done()


def test_fsdp_over_tensor_parallel_restores_onto_other_meshes(tmp_path):
    out = str(tmp_path / "state")
    with LocalCluster(tmp_path, workers=2) as cl:
        _spawn(_two_by_two, 4, free_port(), cl.address, out)
        assert torch.load(f"{out}.end")["committed"] == 3
        last, shadow = _snapshot_state(cl.address, "tp")
        assert last == 3
        want = torch.load(f"{out}.3")
        _equal(shadow, want, "the shadow of the 2x2 run")

        _spawn(_onto, 1, free_port(), cl.address, f"{out}.plain", None)
        plain = torch.load(f"{out}.plain")
        assert plain["iteration"] == 3
        _equal(plain["restored"], want, "restored onto one plain process")

        from shadow.export import export
        from shadow.restore import resolve

        dcp_dir = str(tmp_path / "dcp")
        export(resolve(cl.address, job="tp"), dcp_dir, "dcp")
        _spawn(_onto, 4, free_port(), cl.address, f"{out}.4x1", (4, 1), dcp_dir)
        onto = torch.load(f"{out}.4x1")
        assert onto["iteration"] == 3
        _equal(onto["restored"], want, "restored onto 4x1")
        _equal(onto["dcp"], want, "the DCP export loaded into a 4x1 model")
        assert onto["committed"] == 5
        last, shadow = _snapshot_state(cl.address, "tp")
        assert last == 5
        _equal(shadow, onto["on"], "the shadow of the run resumed on 4x1")
