"""Pipeline stages: ranks whose optimizers hold different parts of one model.

Under pipeline parallelism (``torch.distributed.pipelining``) each rank builds the module
of its stage and an optimizer over its parameters, named as in the whole model
(torchtitan's stages keep the full model's FQNs). The cluster holds the whole model: at
attach, one all-gather of every rank's layout (and split) joins the stages' layouts into
one (:class:`Stages`), in the order of the lowest rank that holds each; the stages' param
groups follow one another. A rank's parameters stay contiguous in it, so its local flat
offsets shift by one offset, its parameter and group indices by one index each, and the
commit it sends names what it owns (:meth:`Stages.globalize`): the workers join the
stages' records into one (``shadow.worker.commit.merge``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shadow.core.errors import ShadowUsageError
from shadow.core.layout import Layout


@dataclass(frozen=True)
class Stages:
    """The whole model's layout and split, and where this rank's part lies in it."""

    layout: Layout  # every stage's parameters
    split: list  # the whole model's split (``shadow.core.split``), global indices
    count: int  # how many distinct stages
    param0: int  # global index of this rank's first parameter
    group0: int  # ... and of its first param group
    offset: int  # flat offset of its first element
    params: int  # how many parameters it holds
    groups: int  # ... and param groups

    def globalize(self, replay: dict) -> dict:
        """A commit record of this rank's optimizer (local indices) in the whole model's
        terms: its groups at their place (``None`` for the other stages'), skipped
        parameters and per-parameter step counts at theirs, and ``owns``: the parameters
        ``[first, end)`` and groups it speaks for."""
        out = dict(replay)
        n, g = len(self.layout.params), self.layout.num_groups
        out["groups"] = [None] * self.group0 + list(replay["groups"]) + [None] * (g - self.group0 - self.groups)
        out["skipped"] = [self.param0 + i for i in replay["skipped"]]
        for key, zero in (("steps", 0.0), ("has_state", False)):
            if key in replay:
                out[key] = [zero] * self.param0 + list(replay[key]) + [zero] * (n - self.param0 - self.params)
        out["owns"] = [self.param0, self.param0 + self.params, self.group0, self.group0 + self.groups]
        return out


def gather_device() -> torch.device:
    """Where the default group's collectives take their tensors."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_bytes(blob: bytes) -> list[bytes]:
    """Every rank's ``blob`` over the default group (two all-gathers: lengths, then bytes)."""
    dev, world = gather_device(), dist.get_world_size()
    n = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else mine[:0]
    every = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(every, mine.to(dev))
    return [bytes(t.cpu()[: int(s.item())].numpy().tobytes()) for t, s in zip(every, sizes, strict=True)]


def gather(layout: Layout, split: list, optim: dict) -> Stages | None:
    """Join every rank's ``layout`` and ``split`` (this rank's, local indices) into the
    whole model's; None when every rank lays out the same model (no pipeline stages). A
    collective over the default group. Refused (on every rank alike): a parameter in two
    stages, or stages whose optimizers differ in kind or implementation."""
    kind = {k: optim.get(k) for k in ("kind", "impl", "vec_width", "tail_width")}
    mine = json.dumps({"layout": layout.to_dict(), "split": split, "optim": kind}, sort_keys=True).encode()
    every = [json.loads(b) for b in _gather_bytes(mine)]
    if all(e["layout"] == every[0]["layout"] for e in every):
        return None
    if any(e["optim"] != every[0]["optim"] for e in every):
        seen = sorted({json.dumps(e["optim"], sort_keys=True) for e in every})
        raise ShadowUsageError(
            f"the pipeline stages' optimizers differ ({'; '.join(seen)}): the shadow replays one optimizer "
            "kind and implementation for the whole model; build every stage's optimizer alike"
        )
    distinct: list[dict] = []
    for e in every:  # in the order of the lowest rank holding each
        if all(e["layout"] != d["layout"] for d in distinct):
            distinct.append(e)
    entries: list = []
    whole_split: list = []
    owner: dict[str, int] = {}
    me = dist.get_rank()
    groups = params = 0
    here = None
    for s, d in enumerate(distinct):
        stage = Layout.from_dict(d["layout"])
        if stage.to_dict() == layout.to_dict() and every[me]["layout"] == d["layout"]:
            here = (params, groups, len(stage.params), stage.num_groups)
        for spec in stage.params:
            if spec.name in owner:
                raise ShadowUsageError(
                    f"parameter {spec.name!r} is in pipeline stages {owner[spec.name]} and {s}: the shadow keeps one "
                    "copy of each parameter; tie weights within a stage, or give each stage's its own name"
                )
            owner[spec.name] = s
            entries.append((spec.name, spec.shape, spec.group + groups, spec.requires_grad))
        whole_split += [[i + params, cuts] for i, cuts in d["split"]]
        params += len(stage.params)
        groups += stage.num_groups
    assert here is not None  # this rank's own layout is among them
    whole = Layout.build(entries, groups)
    return Stages(whole, whole_split, len(distinct), here[0], here[1], whole.params[here[0]].offset, here[2], here[3])
