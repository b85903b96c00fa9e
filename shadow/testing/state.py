"""Bit-for-bit comparison of trainer state: ``{"model": state_dict, "optimizer":
optimizer state_dict, "scheduler": ...}`` dicts, as a trainer saves them."""

from __future__ import annotations

import torch


def _tensors(where: str, a: dict, b: dict, out: list[str]) -> None:
    if a.keys() != b.keys():
        out.append(f"{where}: keys only on one side: {sorted(map(str, a.keys() ^ b.keys()))[:5]}")
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(f"{where} {k}")
        elif x != y:
            out.append(f"{where} {k}: {x!r} vs {y!r}")


def state_differences(a: dict, b: dict) -> list[str]:
    """What differs between two trainer states, bit for bit (empty when they are equal):
    the model's tensors (dtype, shape and every bit), the optimizer's per-parameter state
    and param groups, and the scheduler's state where either side has one."""
    out: list[str] = []
    _tensors("model", a["model"], b["model"], out)
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    if sa.keys() != sb.keys():
        out.append(f"optimizer state for params {sorted(sa.keys() ^ sb.keys())[:5]} only on one side")
    for i in sorted(sa.keys() & sb.keys()):
        _tensors(f"optimizer state {i}", sa[i], sb[i], out)
    if a["optimizer"]["param_groups"] != b["optimizer"]["param_groups"]:
        out.append(f"param_groups: {a['optimizer']['param_groups']} vs {b['optimizer']['param_groups']}")
    if ("scheduler" in a or "scheduler" in b) and a.get("scheduler") != b.get("scheduler"):
        out.append(f"scheduler: {a.get('scheduler')} vs {b.get('scheduler')}")
    return out


def assert_same_state(a: dict, b: dict) -> None:
    """AssertionError naming every difference between two trainer states."""
    problems = state_differences(a, b)
    assert not problems, "; ".join(problems[:20])


def ulp_report(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``{"max_ulp", "frac_diff"}``: the largest distance in units in the last place between
    two float32 tensors (as float32: another dtype is converted first), and the fraction
    of elements that differ at all."""
    x, y = a.detach().float().cpu().reshape(-1), b.detach().float().cpu().reshape(-1)

    def ordered(t):
        i = t.view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    diff = (ordered(x) - ordered(y)).abs()
    return {
        "max_ulp": int(diff.max()) if diff.numel() else 0,
        "frac_diff": float((diff != 0).float().mean()) if diff.numel() else 0.0,
    }


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None) -> dict:
    """A live model's and optimizer's (and scheduler's) state as :func:`assert_same_state`
    compares it."""
    out = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    return out
