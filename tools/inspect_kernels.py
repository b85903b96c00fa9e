"""Read the replay kernels' inner loops as LLVM compiles them for a given CPU, on any host.

    python tools/inspect_kernels.py [--cpu skylake-avx512 icelake-server znver3 ...] [--asm-dir DIR]

For every CPU name the kernels are compiled (not run: the target's instructions need not
exist here) with ``NUMBA_CPU_NAME`` set, in a child process with a cache of its own.
Every innermost loop of the Adam and SGD kernels that does packed float arithmetic is
listed with its vector width, how many divisions, square roots and FMAs one iteration
issues, and, where ``llvm-mca`` is installed (``apt install llvm``), the scheduling
model's reciprocal throughput of one iteration: cycles per element if the loop is bound
by the core (the divider, on Intel) rather than by memory.

A loop that did not vectorise shows width 1 (scalar ``ss`` operations only).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPUS = ("skylake-avx512", "icelake-server", "znver3")

_CHILD = r"""
import json, sys
from numba import types
from shadow.kernels import adam, sgd
from shadow.kernels.adam_columns import RULE_CPU, RULE_CPU_TABLE, RULE_CUDA_FOREACH, RULE_CUDA_FUSED
f32a, i64a = types.Array(types.float32, 1, "C"), types.Array(types.int64, 1, "C")
i64m, f32m = types.Array(types.int64, 2, "C"), types.Array(types.float32, 2, "C")
u32a, i32a = types.Array(types.uint32, 1, "C"), types.Array(types.int32, 1, "C")
asig = (f32a,) * 4 + (i64a, i64a, i64m, f32m, i64m) + (f32a,) * 4 + (u32a, i32a)
sigs = {
    "adam": (adam.KERNELS[RULE_CPU][0], asig),
    "adam_cuda_fused": (adam.KERNELS[RULE_CUDA_FUSED][0], asig),
    "adam_cuda_foreach": (adam.KERNELS[RULE_CUDA_FOREACH][0], asig),
    "adam_cpu_table": (adam.KERNELS[RULE_CPU_TABLE][0], asig),
    "sgd": (sgd.sgd_apply, (f32a, f32a, i64a, i64a, i64m, f32m, i64m, f32a, f32a)),
}
from numba import njit
from shadow.kernels._fma import fma32

@njit(error_model="numpy")
def reference(p, m, v, g, w1, b2, c2, bc2s, eps, nstep, dec):
    # AdamW in torch's operation order with no option: the floor for the Adam loops
    for i in range(p.shape[0]):
        gi = g[i]
        mi = fma32(w1, gi - m[i], m[i])
        vi = fma32(c2 * gi, gi, v[i] * b2)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * dec + (nstep * mi) / (np.sqrt(vi) / bc2s + eps)

import numpy as np
sigs["reference"] = (reference, (f32a,) * 4 + (types.float32,) * 7)
out = {}
for name, (fn, sig) in sigs.items():
    fn.compile(sig)
    out[name] = fn.inspect_asm(sig)
json.dump(out, sys.stdout)
"""

_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_BRANCH = re.compile(r"^\s+j\w+\s+(\.LBB\d+_\d+)")
_WIDTH = {"xmm": 4, "ymm": 8, "zmm": 16}


def compile_for(cpu: str, features: str = "") -> dict[str, str]:
    """The kernels' assembly for ``cpu``, compiled in a child process."""
    with tempfile.TemporaryDirectory(prefix="shadow-asm-") as cache:
        # a feature every x86-64 target has: numba would otherwise pass this host's
        # feature list (with e.g. -avx512f on an AMD host) instead of the CPU's own
        env = dict(
            os.environ,
            NUMBA_CPU_NAME=cpu,
            NUMBA_CPU_FEATURES=",".join(["+cmov"] + [features] * bool(features)),
            NUMBA_CACHE_DIR=cache,
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"compiling for {cpu} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def _blocks(asm: str) -> list[tuple[str | None, list[str]]]:
    """Basic blocks ``(label, instructions)``, split at labels and after every jump."""
    blocks: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in asm.splitlines():
        m = _LABEL.match(line) or re.match(r"^([A-Za-z_][\w.$]*):", line)
        body = blocks[-1][1]
        if m or (body and re.match(r"^\s+(j\w+|ret)", body[-1])):
            blocks.append((m.group(1) if m else None, []))
        if line.startswith("\t") and not line.lstrip().startswith("."):
            blocks[-1][1].append(line)
    return blocks


def loops(asm: str) -> list[list[str]]:
    """Innermost natural loops doing packed float arithmetic, each as the instructions of
    its cheapest cycle through the loop header. A segment's choices (weight decay or not,
    the tail rule, ...) are uniform over a loop, and LLVM lowers a uniform choice between
    two vectors as a branch; the cheapest cycle is the path with the fewest optional
    operations, the one the common configuration (AdamW, no grad-scale division) takes."""
    blocks = _blocks(asm)
    index = {lab: i for i, (lab, _) in enumerate(blocks) if lab}
    succ: list[list[int]] = []
    for i, (_, body) in enumerate(blocks):
        last = body[-1] if body else ""
        out = []
        b = _BRANCH.match(last)
        if b and b.group(1) in index:
            out.append(index[b.group(1)])
        if not re.match(r"^\s+(jmp|ret)", last) and i + 1 < len(blocks):
            out.append(i + 1)
        succ.append(out)
    pred: list[list[int]] = [[] for _ in blocks]
    for i, out in enumerate(succ):
        for j in out:
            pred[j].append(i)
    # back edges by depth-first search (iterative: the kernels have thousands of blocks)
    state = [0] * len(blocks)  # 0 new, 1 on the stack, 2 done
    back: list[tuple[int, int]] = []
    for root in range(len(blocks)):
        if state[root]:
            continue
        stack = [(root, iter(succ[root]))]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state[nxt] == 1:
                back.append((node, nxt))
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
    bodies: dict[int, set[int]] = {}
    for tail, head in back:
        body = bodies.setdefault(head, {head})
        work = [tail]
        while work:
            n = work.pop()
            if n not in body:
                body.add(n)
                work.extend(pred[n])
    arith = re.compile(r"^\s+v(add|sub|mul|div|sqrt|fn?madd|fn?msub)\w*p[sd]\s")
    out = []
    for head, body in sorted(bodies.items()):
        if any(h != head and h in body for h in bodies):
            continue  # holds another loop: not innermost
        if any(arith.match(x) for i in body for x in blocks[i][1]):
            out.append(_cheapest_cycle(head, body, succ, blocks))
    return out


def _cost(block: list[str]) -> int:
    """Instructions, a division or square root counting as 10 (they bound the kernel)."""
    return sum(10 if re.match(r"^\s+v(div|sqrt)", x) else 1 for x in block)


def _cheapest_cycle(head: int, body: set[int], succ: list[list[int]], blocks) -> list[str]:
    """Instructions of the cheapest path (:func:`_cost`) from ``head`` back to it."""
    best, prev = {head: _cost(blocks[head][1])}, {}
    heap = [(best[head], head)]
    end = None
    while heap:
        cost, i = heapq.heappop(heap)
        if cost > best.get(i, 1 << 60):
            continue
        for j in succ[i]:
            if j == head:
                if end is None or cost < end[0]:
                    end = (cost, i)
            elif j in body and cost + _cost(blocks[j][1]) < best.get(j, 1 << 60):
                best[j], prev[j] = cost + _cost(blocks[j][1]), i
                heapq.heappush(heap, (best[j], j))
    path, i = [], end[1] if end else head
    while i != head:
        path.append(i)
        i = prev[i]
    path.append(head)
    return [x for i in reversed(path) for x in blocks[i][1]]


def describe(body: list[str]) -> dict:
    packed = [x for x in body if re.match(r"^\s+v\w+p[sd]\s", x)]
    width = max((_WIDTH[r] for x in packed for r in _WIDTH if f"%{r}" in x), default=1)

    def count(pat: str) -> int:
        return sum(bool(re.match(r"^\s+" + pat, x)) for x in body)

    return {
        "width": width,
        "instructions": len(body),
        "div": count(r"vdivp"),
        "sqrt": count(r"vsqrtp"),
        "fma": count(r"vfn?m(add|sub)\d+p"),
        "branches": count(r"j(?!mp)\w+\s"),
    }


def mca(cpu: str, body: list[str]) -> float | None:
    """llvm-mca's reciprocal throughput of one iteration (cycles), or None without it."""
    tool = shutil.which("llvm-mca") or next(
        (shutil.which(f"llvm-mca-{v}") for v in range(25, 13, -1) if shutil.which(f"llvm-mca-{v}")), None
    )
    if tool is None:
        return None
    res = subprocess.run(
        [tool, f"-mcpu={cpu}", "-iterations=200"],
        input="\n".join(body) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    m = re.search(r"Total Cycles:\s+(\d+)", res.stdout)
    return int(m.group(1)) / 200 if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", nargs="+", default=list(CPUS))
    ap.add_argument("--asm-dir", default="", help="also write each kernel's assembly here")
    ap.add_argument("--features", default="", help="LLVM features to add, e.g. -prefer-256-bit (512-bit vectors)")
    args = ap.parse_args()
    print("| cpu | kernel | loop | width | div | sqrt | fma | instructions | cycles/iter (llvm-mca) | cycles/element |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cpu in args.cpu:
        for kernel, asm in compile_for(cpu, args.features).items():
            if args.asm_dir:
                Path(args.asm_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.asm_dir) / f"{kernel}-{cpu}.s").write_text(asm)
            for i, body in enumerate(loops(asm)):
                d = describe(body)
                cyc = mca(cpu, body)
                per = f"{cyc / d['width']:.2f}" if cyc is not None else "-"
                print(
                    f"| {cpu} | {kernel} | {i} | {d['width']} | {d['div']} | {d['sqrt']} | {d['fma']} | "
                    f"{d['instructions']} | {cyc if cyc is not None else '-'} | {per} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
