"""Which replay rule reproduces the trainer's optimizer, measured at attach on the
trainer's own device (CUDA's rules on a GPU; on the CPU, the one rule of its
implementation, checked).

The trainer's optimizer class, with its first param group's settings and its
implementation (fused, foreach, single-tensor), steps probe tensors on the device:
several tensors in one optimizer, sizes that are and are not multiples of 4, a view at
an odd offset, the trainer's hyperparameters and a large lr * weight decay, and a step
count in the thousands. The shadow's kernels replay the same steps on this CPU with each
candidate rule; the first that reproduces every element of every state array is used.
When none does, the closest is used and ``bit_exact`` is False: attach refuses it unless
``exact=False`` (:func:`trainer_hooks.optim.describe.describe`). A new torch version, GPU or CPU
thus selects or rejects a rule itself instead of drifting silently. A fused optimizer
also takes one step under a GradScaler ``grad_scale``. One synchronisation, at attach.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from shadow.core import optimizers
from shadow.core.optimizers.spec import OptimSpec
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import ReplayPlan, powtab, segments_for_range
from shadow.wire.frames import Field

logger = logging.getLogger(__name__)

SIZES = (4096, 4099, 1000, 5)
LONG_STEP = 5000  # a step count in the thousands (bias corrections near 1)
SCALED_STEP, GRAD_SCALE = 2, 3000.0  # a fused step under GradScaler: the kernel divides by grad_scale


@dataclass
class Calibration:
    impl: str  # the replay implementation chosen
    bit_exact: bool
    max_ulp: int  # of the chosen rule, over every probe
    tried: dict  # candidate -> max ulp
    powers: list | None = None  # optim["pow"]: where the device's beta ** k differs from the reference


def device_powers(optimizer: torch.optim.Optimizer, device: torch.device) -> list:
    """``optim["pow"]`` entries for every beta of ``optimizer``: ``beta ** k`` for k = 1
    up to :func:`shadow.kernels.powtab.limit` computed on ``device`` (as its fused kernel
    does, in float32), kept where it differs from the reference."""
    betas = sorted({powtab.bits(b) for g in optimizer.param_groups for b in g.get("betas", ())})
    out = []
    for b_bits in betas:
        beta = float(powtab.from_bits(b_bits))
        n = powtab.limit(beta)
        ks = torch.arange(1, n + 1, dtype=torch.float32, device=device)
        values = torch.pow(torch.full_like(ks, beta), ks).cpu().numpy()
        out.append([b_bits, powtab.exceptions(beta, values), n])
    return out


def _ulp(a: np.ndarray, b: np.ndarray) -> int:
    def ordered(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    if not len(a):
        return 0
    nan = np.isnan(a) & np.isnan(b)
    d = np.abs(ordered(a) - ordered(b))
    d[nan] = 0
    return int(d.max())


def _probe_tensors(gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    out = []
    for n in SIZES:
        x = torch.randn(n, generator=gen) * scale
        band = min(n, 256)  # magnitudes from 1e-12 to 1e4, and zeros
        x[:band] *= torch.logspace(-12, 4, band)
        x[band // 2 : band // 2 + 4] = 0.0
        out.append(x)
    return out


def _settings(optimizer: torch.optim.Optimizer, spec: OptimSpec) -> dict:
    """The first param group's settings, as the optimizer's constructor takes them."""
    g = optimizer.param_groups[0]
    keys = list(spec.group.WIRE)
    out = {k: g[k] for k in keys if k in g}
    for flag in spec.probe_flags.get(type(optimizer).__name__, ()):
        if g.get(flag):
            out[flag] = True
    for flag in ("fused", "foreach"):
        if g.get(flag) is not None:
            out[flag] = g[flag]
    return out


def _run_device(cls, settings: dict, device: torch.device, p0: list, grads: list, spec: OptimSpec) -> list[list]:
    """Step the probes on ``device``: each step's state arrays (on the host)."""
    base = torch.zeros(sum(SIZES) + 1, device=device)  # the last probe is a view at an odd offset
    params = []
    at = 0
    for i, x in enumerate(p0):
        if i == len(p0) - 1:
            t = base[at + 1 : at + 1 + len(x)]
            t.copy_(x.to(device))
            params.append(torch.nn.Parameter(t))
        else:
            params.append(torch.nn.Parameter(x.clone().to(device)))
        at += len(x)
    opt = cls(params, **settings)
    out = []
    for k, gs in enumerate(grads, start=1):
        if k == len(grads) and spec.has_step:  # jump to a step count in the thousands
            for p in params:
                opt.state[p]["step"].fill_(LONG_STEP - 1)
        scaled = k == SCALED_STEP and settings.get("fused")
        for p, g in zip(params, gs, strict=True):
            p.grad = (g * GRAD_SCALE if scaled else g.clone()).to(device)
        if scaled:  # what GradScaler.step hands a fused optimizer
            opt.grad_scale = torch.tensor(GRAD_SCALE, device=device)
            opt.found_inf = torch.tensor(0.0, device=device)
        opt.step()
        if scaled:
            del opt.grad_scale, opt.found_inf
        arrays = [np.concatenate([p.detach().cpu().numpy() for p in params])]
        for slot in spec.slots:
            if all(opt.state[p].get(slot.torch_key) is not None for p in params):
                arrays.append(np.concatenate([opt.state[p][slot.torch_key].detach().cpu().numpy() for p in params]))
        out.append(arrays)
    return out


def _replay(
    impl: str,
    settings: dict,
    p0: list,
    grads: list,
    spec: OptimSpec,
    cls_name: str,
    widths: tuple[int, int],
    powers: powtab.PowTable,
    sqrt: SqrtTable | None = None,
) -> list[list]:
    sizes = [len(x) for x in p0]
    offsets = list(np.cumsum([0] + sizes)[:-1])
    total = sum(sizes)
    segs = segments_for_range(offsets, sizes, [0] * len(sizes), 0, total, impl, widths[0], widths[1])
    plan = ReplayPlan(segs, impl, 4096, spec.kind, powers, sqrt if impl in spec.sqrt_impls else None)
    group = spec.group_from_torch(settings, cls_name)
    # the fields torch keeps for this group: PARAM, then the slots it allocates
    kept: tuple[Field, ...] = (Field.PARAM,)
    if spec.keeps_state(group):
        kept += tuple(s.field for s in spec.slots if s.group_flag is None or settings.get(s.group_flag))
    arrays = {f: np.zeros(total if f in kept else 0, np.float32) for f in spec.all_fields}
    arrays[Field.PARAM] = np.concatenate([x.numpy() for x in p0]).astype(np.float32)
    out = []
    for k, gs in enumerate(grads, start=1):
        scaled = k == SCALED_STEP and settings.get("fused")
        g = np.concatenate([(x * GRAD_SCALE if scaled else x).numpy() for x in gs]).astype(np.float32)
        step = float(LONG_STEP if k == len(grads) and spec.has_step else k)
        plan.fill(
            [group],
            np.full(len(sizes), step),
            np.full(len(sizes), k > 1),
            set(),
            grad_scale=np.float32(GRAD_SCALE) if scaled else None,
        )
        plan.apply(*(arrays[f] for f in spec.all_fields), g, threads=False)
        out.append([arrays[f].copy() for f in kept])
    return out


def calibrate_device(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    spec: OptimSpec | str,
    impl: str,
    candidates: tuple[str, ...] | None = None,
    widths: tuple[int, int] = (16, 8),
    sqrt: SqrtTable | None = None,
) -> Calibration:
    """The replay rule for ``optimizer`` (its spec, or descriptor kind; torch implementation ``impl``) on ``device``:
    the first of ``candidates`` (default: the CUDA rules for ``impl``) that reproduces it;
    ``widths``: the CPU fused kernel's vector and tail widths, for CPU candidates;
    ``sqrt``: the square root table of the CPU single-tensor and foreach candidates."""
    if isinstance(spec, str):
        spec = optimizers.spec(spec)
    cls = type(optimizer)
    mine = _settings(optimizer, spec)
    probes = [mine]
    if mine.get("weight_decay", 0.0) != 0 or spec.probe_big_decay:
        probes.append(dict(mine, lr=0.1, weight_decay=0.5))  # a large lr * weight decay
    gen = torch.Generator().manual_seed(20261201)
    p0 = _probe_tensors(gen, 0.05)
    grads = [_probe_tensors(gen, 1e-3) for _ in range(4)]
    from shadow.kernels import _cache

    threads = torch.get_num_threads()
    try:
        with _cache.compile_lock():  # ranks and workers on one host compile the kernels once
            powers = device_powers(optimizer, device) if spec.uses_powtab else []
            cal = _measure(
                cls,
                probes,
                device,
                p0,
                grads,
                spec,
                candidates or spec.cuda_candidates.get(impl, ()),
                widths,
                powtab.PowTable(powers),
                sqrt,
            )
            cal.powers = powers if cal.impl == "cuda_fused" else None
            return cal
    finally:
        if torch.get_num_threads() != threads:  # numba's threading layer may have changed torch's
            torch.set_num_threads(threads)


def _measure(cls, probes, device, p0, grads, spec, candidates, widths, powers, sqrt) -> Calibration:
    tried: dict[str, int] = {}
    for cand in candidates:
        worst = 0
        for settings in probes:
            want = _run_device(cls, settings, device, p0, grads, spec)
            got = _replay(cand, settings, p0, grads, spec, cls.__name__, widths, powers, sqrt)
            for w_step, g_step in zip(want, got, strict=True):
                for w, g in zip(w_step, g_step, strict=True):
                    worst = max(worst, _ulp(w, g))
        tried[cand] = worst
        if worst == 0:
            logger.debug("%s on %s replayed bit for bit with %s", cls.__name__, device, cand)
            return Calibration(cand, True, 0, tried)
    best = min(tried, key=lambda c: tried[c])
    return Calibration(best, False, tried[best], tried)
