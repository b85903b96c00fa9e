"""Pipeline parallelism (``torch.distributed.pipelining``) checkpointed every iteration
(issue 55), on CPU with gloo against a real cluster: a Llama-shaped stack split into two
stages the way torchtitan splits one (the whole model with the other stages' modules
deleted: FQNs stay the whole model's), each stage's ranks with an optimizer of their own,
GPipe and 1F1B schedules over 4 micro-batches, and a clip over the whole model (each
stage's norm reduced over the stages, as torchtitan clips).

What is checked, with ``torch.equal`` on every parameter and moment of both stages: the
shadow's newest iteration equals the whole model's state (an iteration commits once every
stage's ranks have sent it); ranks killed with SIGKILL restore it (each stage by name, its
part only), resume, and end where an uninterrupted run ends, losses bit for bit; the
checkpoint restores onto one plain process holding the whole model, and a run of two plain
stages restores onto two stages of FSDP2 over two ranks each and trains on attached."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from shadow.testing import LocalCluster, free_port
from tests.helpers import parallel as P
from tests.slow.test_fsdp import _done, _equal, _snapshot_state, _spawn

pytestmark = pytest.mark.slow

STEPS_BEFORE_KILL = 3
STEPS = 5


def _build(rank: int, world: int, port: int, shape, schedule: str, impl: str = "foreach"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    m = P.stage_module(pp, shape[0])
    if shape[1] > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    opt = P.optimizer(m, impl)
    stage = PipelineStage(m, pp, shape[0], torch.device("cpu"), group=mesh["pp"].get_group())
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=4, loss_fn=P.loss_fn)
    return mesh, m, opt, sched, pp, dp


def _step(mesh, m, opt, sched, it: int, pp: int, dp: int) -> list[float]:
    x, y = P.batch(it, dp)
    losses: list = []
    if pp == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=losses)
    P.clip_across_stages(list(m.parameters()), 1.0, mesh["pp"].get_group())
    opt.step()
    opt.zero_grad()
    return [loss.item() for loss in losses]


def _save(state: dict, pp: int, dp: int, path: str) -> None:
    if dp == 0:
        torch.save(state, f"{path}.stage{pp}")


def _whole(path: str, stages: int = 2) -> dict:
    out: dict = {}
    for s in range(stages):
        out.update(torch.load(f"{path}.stage{s}"))
    return out


def _uninterrupted(rank, world, port, out, shape, schedule) -> None:
    mesh, m, opt, sched, pp, dp = _build(rank, world, port, shape, schedule)
    losses = [_step(mesh, m, opt, sched, it, pp, dp) for it in range(1, STEPS + 1)]
    _save({"state": P.full(m, opt), "losses": losses}, pp, dp, out)
    _done()


def _trained(rank, world, port, address, out, shape, schedule) -> None:
    import trainer_hooks

    mesh, m, opt, sched, pp, dp = _build(rank, world, port, shape, schedule)
    trainer_hooks.attach(m, opt, address, job="pp")
    for it in range(1, STEPS_BEFORE_KILL + 1):
        _step(mesh, m, opt, sched, it, pp, dp)
        _save(P.full(m, opt), pp, dp, f"{out}.{it}")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _resumed(rank, world, port, address, out, shape, schedule) -> None:
    import trainer_hooks

    mesh, m, opt, sched, pp, dp = _build(rank, world, port, shape, schedule)
    info = trainer_hooks.restore(m, opt, address, job="pp")
    restored = P.full(m, opt)
    session = trainer_hooks.attach(m, opt, address, job="pp")
    losses = [_step(mesh, m, opt, sched, it, pp, dp) for it in range(info.iteration + 1, STEPS + 1)]
    committed = session.close()
    state = P.full(m, opt)
    _save(
        {"iteration": info.iteration, "restored": restored, "losses": losses, "committed": committed, "state": state},
        pp,
        dp,
        out,
    )
    _done()


def _plain(rank, world, port, address, out) -> None:
    """One process, the whole model, one optimizer: the checkpoint of two stages by name."""
    import trainer_hooks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = P.whole()
    opt = P.optimizer(m, "foreach")
    info = trainer_hooks.restore(m, opt, address, job="pp")
    torch.save({"iteration": info.iteration, "restored": P.full(m, opt)}, out)
    _done()


def test_pipeline_with_fsdp_killed_restored_and_resumed_bit_for_bit(tmp_path):
    shape, world, schedule = (2, 2), 4, "gpipe"
    out = str(tmp_path / "state")
    _spawn(_uninterrupted, world, free_port(), f"{out}.uninterrupted", shape, schedule)
    end = [torch.load(f"{out}.uninterrupted.stage{s}") for s in (0, 1)]
    want_end = {**end[0]["state"], **end[1]["state"]}
    with LocalCluster(tmp_path, workers=2) as cl:
        _spawn(_trained, world, free_port(), cl.address, out, shape, schedule, killed=True)
        it, shadow = _snapshot_state(cl.address, "pp")
        assert 1 <= it <= STEPS_BEFORE_KILL, it
        _equal(shadow, _whole(f"{out}.{it}"), f"the shadow's iteration {it}")

        _spawn(_resumed, world, free_port(), cl.address, f"{out}.resumed", shape, schedule)
        resumed = [torch.load(f"{out}.resumed.stage{s}") for s in (0, 1)]
        assert [r["iteration"] for r in resumed] == [it, it]
        _equal({**resumed[0]["restored"], **resumed[1]["restored"]}, _whole(f"{out}.{it}"), f"restored {it}")
        assert [r["committed"] for r in resumed] == [STEPS, STEPS]
        _equal({**resumed[0]["state"], **resumed[1]["state"]}, want_end, "the resumed run's end")
        assert resumed[1]["losses"] == end[1]["losses"][it:], "losses after the restore"
        last, shadow = _snapshot_state(cl.address, "pp")
        assert last == STEPS
        _equal(shadow, want_end, "the shadow's last iteration")

        _spawn(_plain, 1, free_port(), cl.address, f"{out}.plain")
        plain = torch.load(f"{out}.plain")
        assert plain["iteration"] == STEPS
        _equal(plain["restored"], want_end, "restored onto one plain process")


def _attached(rank, world, port, address, out, shape, schedule) -> None:
    import trainer_hooks

    mesh, m, opt, sched, pp, dp = _build(rank, world, port, shape, schedule, impl="fused")
    session = trainer_hooks.attach(m, opt, address, job="pp")
    for it in range(1, 4):
        _step(mesh, m, opt, sched, it, pp, dp)
    committed = session.close()
    _save({"committed": committed, "state": P.full(m, opt)}, pp, dp, out)
    _done()


def _onto_fsdp(rank, world, port, address, out, shape, schedule) -> None:
    import trainer_hooks

    mesh, m, opt, sched, pp, dp = _build(rank, world, port, shape, schedule, impl="fused")
    info = trainer_hooks.restore(m, opt, address, job="pp")
    restored = P.full(m, opt)
    session = trainer_hooks.attach(m, opt, address, job="pp")
    for it in range(info.iteration + 1, info.iteration + 3):
        _step(mesh, m, opt, sched, it, pp, dp)
    committed = session.close()
    _save(
        {"iteration": info.iteration, "restored": restored, "committed": committed, "on": P.full(m, opt)}, pp, dp, out
    )
    _done()


def test_plain_stages_with_1f1b_restore_onto_stages_of_fsdp(tmp_path):
    out = str(tmp_path / "state")
    with LocalCluster(tmp_path, workers=2) as cl:
        _spawn(_attached, 2, free_port(), cl.address, out, (2, 1), "1f1b")
        ran = [torch.load(f"{out}.stage{s}") for s in (0, 1)]
        assert [r["committed"] for r in ran] == [3, 3]
        want = {**ran[0]["state"], **ran[1]["state"]}
        last, shadow = _snapshot_state(cl.address, "pp")
        assert last == 3
        _equal(shadow, want, "the shadow of two plain stages")

        _spawn(_onto_fsdp, 4, free_port(), cl.address, f"{out}.onto", (2, 2), "1f1b")
        onto = [torch.load(f"{out}.onto.stage{s}") for s in (0, 1)]
        assert [r["iteration"] for r in onto] == [3, 3]
        _equal({**onto[0]["restored"], **onto[1]["restored"]}, want, "restored onto 2 stages of FSDP2 on 2 ranks")
        assert [r["committed"] for r in onto] == [5, 5]
        last, shadow = _snapshot_state(cl.address, "pp")
        assert last == 5
        _equal(shadow, {**onto[0]["on"], **onto[1]["on"]}, "the shadow of the run resumed on 2 x 2")
