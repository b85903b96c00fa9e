"""Which optimizer update the shadow must replay, read at attach time.

For the fused CPU kernel, which elements take the compiler's scalar remainder path
depends on the CPU build, so :func:`calibrate` checks the numba kernel against torch on
this machine and picks the widths that match. The single-tensor and foreach CPU paths
take their square roots from MKL, measured here (:func:`cpu_sqrt_table`). Whatever the
path, :func:`describe` then steps the trainer's own optimizer on probes and checks that
the replay reproduces every bit, or refuses it (unless ``exact=False``).
"""

from __future__ import annotations

import functools
import logging
import warnings

import numpy as np
import torch

from shadow.core import sqrttab
from shadow.core.optimizers.adam import ADAM
from shadow.core.sqrttab import SqrtTable
from trainer_hooks.optim.registry import UnsupportedOptimizerError, replay_groups, spec_for
from trainer_hooks.optim.registry import unsupported as _unsupported

__all__ = ["UnsupportedOptimizerError", "calibrate", "cpu_sqrt_table", "describe", "replay_groups", "wire_groups"]

logger = logging.getLogger(__name__)


def _impl(group: dict, params: list[torch.Tensor]) -> str:
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    if group.get("foreach") is None and params and all(p.is_cuda for p in params):
        return "foreach"  # torch's default on CUDA
    return "single"


def wire_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """:func:`replay_groups` as a commit record carries them."""
    return [g.to_wire() for g in replay_groups(optimizer)]


def describe(optimizer: torch.optim.Optimizer, exact: bool = True) -> dict:
    """The replay descriptor sent at attach: kind, implementation, kernel widths, and what
    the replay needs of this machine (CUDA's powers, the CPU's square root table).

    The replay is checked here against the trainer's own optimizer class, settings and
    implementation, stepping probes on its device (:func:`trainer_hooks.optim.calibrate.calibrate_device`).
    When it is not bit-identical, ``exact`` refuses the optimizer (``UnsupportedOptimizerError``
    naming the cause and the fixes); ``exact=False`` warns and goes on, ``bit_exact`` false."""
    spec = spec_for(optimizer)
    impls = set()
    for g in optimizer.param_groups:
        if g.get("capturable") or g.get("differentiable"):
            raise _unsupported("capturable/differentiable optimizers are not replayed")
        impls.add(_impl(g, g["params"]))
    if len(impls) != 1:
        raise _unsupported(f"param groups use different implementations {sorted(impls)}")
    replay_groups(optimizer)  # validates hyperparameter types
    impl = impls.pop()
    if impl not in spec.impls:
        raise _unsupported(f"{type(optimizer).__name__} with {impl}=True is not replayed (replayed: {spec.impls})")
    name = f"{type(optimizer).__name__} ({impl})"
    cuda = next((p.device for g in optimizer.param_groups for p in g["params"] if p.is_cuda), None)
    from trainer_hooks.optim.calibrate import calibrate_device  # numba: loaded at attach, not at import

    powers, table, note = None, None, ""
    if cuda is not None:
        vec, tail = 16, 8
        cal = calibrate_device(optimizer, cuda, spec, impl)
        where = f"CUDA {name} on {torch.cuda.get_device_name(cuda)} with torch {torch.__version__}"
        impl, powers = cal.impl, cal.powers
    else:
        vec, tail, _ = calibrate() if impl == "fused" and spec.has_tail else (16, 8, True)
        if impl in spec.sqrt_impls:
            table, note = cpu_sqrt_table()  # torch's sqrt here is MKL's, not IEEE's
        cal = calibrate_device(optimizer, torch.device("cpu"), spec, impl, (impl,), (vec, tail), table)
        where = f"CPU {name} with torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"
        if note:
            where += f"; square roots: {note}"
    if not cal.bit_exact:
        cause = (
            f"the shadow cannot replay this {where} bit for bit: the closest rule, {cal.impl}, deviates by up to "
            f"{cal.max_ulp} ulp on the probes stepped at attach (tried: {cal.tried})"
        )
        if exact:
            raise _unsupported(
                f"{cause}. Use another implementation (fused=True, foreach=True or the default), or attach with "
                "exact=False to accept a shadow that may differ by about that much per step (then shown in "
                "shadow status and in every checkpoint's manifest)"
            )
        warnings.warn(f"{cause}; attached with exact=False: the audit reports deviations, not fails", stacklevel=3)
    out = {
        "kind": spec.kind,
        "impl": impl,
        "vec_width": vec,
        "tail_width": tail,
        "bit_exact": cal.bit_exact,
        **spec.describe_flags(optimizer.param_groups),
    }
    if powers is not None:
        out["pow"] = powers  # beta ** k as the trainer's device computes it (shadow/kernels/powtab.py)
    if table is not None:
        out["sqrt"] = table.to_wire()  # sqrt as this CPU's torch computes it (shadow/core/sqrttab.py)
    return out


@functools.lru_cache(maxsize=1)
def cpu_sqrt_table() -> tuple[SqrtTable | None, str]:
    """How torch's CPU ``Tensor.sqrt`` rounds on this machine (:func:`shadow.core.sqrttab.measure`):
    the table the replay of single-tensor and foreach Adam needs, None when it is IEEE's."""
    with torch.no_grad():
        table, note = sqrttab.measure(lambda a: torch.sqrt(torch.from_numpy(a)).numpy())
    logger.debug("torch's CPU sqrt measured: %s", note)
    return table, note


_CANDIDATES = ((16, 8), (8, 8), (16, 16), (8, 4), (16, 4), (4, 4), (32, 8))
_SIZES = tuple(range(1, 50)) + (63, 64, 65, 127, 129, 1000)


@functools.lru_cache(maxsize=1)
def calibrate() -> tuple[int, int, bool]:
    """``(vec_width, tail_width, matched)`` for torch's fused CPU Adam on this machine."""
    from shadow.kernels import _cache

    threads = torch.get_num_threads()
    try:
        with _cache.compile_lock():  # ranks and workers on one host compile the kernels once
            return _calibrate()
    finally:
        # the first numba call initialises its threading layer, which sets the OpenMP
        # thread count torch shares: a trainer run with 1 thread per rank (torchrun's
        # OMP_NUM_THREADS=1) would otherwise oversubscribe its cores from here on
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _calibrate() -> tuple[int, int, bool]:
    from shadow.kernels import ReplayPlan, segments_for_range  # numba: loaded at attach, not at import

    gen = torch.Generator().manual_seed(1234)
    sizes = list(_SIZES)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(2)]
    init = np.concatenate([p.detach().numpy() for p in params])
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    want = np.concatenate([p.detach().numpy() for p in params])
    offsets = list(np.cumsum([0] + sizes)[:-1])
    group = ADAM.group_from_torch(opt.param_groups[0], "AdamW")
    for vec, tail in _CANDIDATES:
        flat, m, v = init.copy(), np.zeros_like(init), np.zeros_like(init)
        plan = ReplayPlan(
            segments_for_range(offsets, sizes, [0] * len(sizes), 0, len(init), "fused", vec, tail),
            "fused",
            4096,
            ADAM.kind,
        )
        for k, gs in enumerate(grads, start=1):
            plan.prepare([group], np.full(len(sizes), float(k)), set(), None)
            plan.apply(flat, m, v, np.zeros(0, np.float32), np.concatenate([g.numpy() for g in gs]), threads=False)
        if np.array_equal(flat.view(np.uint32), want.view(np.uint32)):
            logger.debug("fused Adam calibrated: vec_width=%d tail_width=%d", vec, tail)
            return vec, tail, True
    logger.warning(
        "fused Adam calibration found no exact match on this CPU (%s)", torch.backends.cpu.get_cpu_capability()
    )
    return 16, 8, False
