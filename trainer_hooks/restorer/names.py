"""A restore by name: a model and optimizer that hold part of a checkpoint's parameters
(a pipeline stage of the checkpointed model, or of another split of it) or group them
otherwise (one process restoring a checkpoint of pipeline stages, whose param groups
followed one another). Each live parameter takes the checkpoint's tensor of the same name
and shape; each live param group takes the settings of the checkpoint's group that held
its first parameter."""

from __future__ import annotations

import logging

from shadow.core.errors import LayoutMismatchError
from shadow.core.layout import Layout

logger = logging.getLogger(__name__)


def match(saved: Layout, live: Layout, job: str, iteration: int) -> list[int]:
    """Per parameter of ``live``, the index of the checkpoint's (``saved``) parameter of
    its name; :class:`LayoutMismatchError` naming the first that has none (or another
    shape): nothing was changed."""
    where = {spec.name: i for i, spec in enumerate(saved.params)}
    out = []
    for spec in live.params:
        j = where.get(spec.name)
        if j is None or saved.params[j].shape != spec.shape:
            got = "no parameter of that name" if j is None else f"shape {list(saved.params[j].shape)}"
            raise LayoutMismatchError(
                f"the checkpoint of job {job!r} at iteration {iteration} does not match this model/optimizer: "
                f"parameter {spec.name!r} {list(spec.shape)} has {got} there; nothing was changed"
            )
        out.append(j)
    if len(out) < len(saved.params):
        logger.info(
            "restoring %d of the checkpoint's %d parameters by name (the others belong to other pipeline stages)",
            len(out),
            len(saved.params),
        )
    return out


def subset(sd: dict, saved: Layout, live: Layout, index: list[int]) -> dict:
    """``sd`` (``shadow.export.state.state_dicts`` of the checkpoint) with its optimizer
    state dict made ``live``'s: per-parameter state by ``live``'s indices (``index``: the
    checkpoint's index of each), and ``live``'s param groups with the settings of the
    checkpoint's group of each one's first parameter."""
    optim = sd["optimizer"]
    state = {i: optim["state"][j] for i, j in enumerate(index) if j in optim["state"]}
    groups = []
    for g in range(live.num_groups):
        members = [i for i, spec in enumerate(live.params) if spec.group == g]
        if not members:
            continue
        kinds = {saved.params[index[i]].group for i in members}
        source = optim["param_groups"][saved.params[index[members[0]]].group]
        if len(kinds) > 1 and any(_settings(optim["param_groups"][k]) != _settings(source) for k in kinds):
            logger.warning(
                "param group %d takes parameters of the checkpoint's groups %s, whose settings differ; it gets those "
                "of group %d",
                g,
                sorted(kinds),
                saved.params[index[members[0]]].group,
            )
        groups.append(dict(source, params=members))
    return {**sd, "optimizer": {"state": state, "param_groups": groups}}


def _settings(g: dict) -> dict:
    return {k: v for k, v in g.items() if k != "params"}
