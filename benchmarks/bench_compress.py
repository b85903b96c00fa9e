"""Compression of persisted shards, on real training state: the example GPT trained with
torch AdamW on CPU, then its parameters, exp_avg and exp_avg_sq compressed as the worker
would (16 MiB blocks), plain zstd vs byte planes + zstd at several levels. Prints tables
and writes JSON.

    python benchmarks/bench_compress.py --json docs/bench/compress.json

Figures: ratio = raw bytes / compressed bytes; MB/s = raw MB per second of one thread
(compress, and decompress into a preallocated buffer, checksums included for the planes
codec). One warm-up round, then --repeat rounds with the variants interleaved and their
order rotated each round; each figure is the median. Also measured: the whole shard file
through ``zshard`` (the real code path), background threads (1 vs 2, and zstd's own
multithreading), and the byte-plane (de)interleave with numba vs numpy.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import zstandard
from benchlib import Goal, bars, example_gpt, machine_info

from shadow.config.tuning import Tuning
from shadow.persist import planes, shardfile, zshard

TUNING = Tuning.load()  # the knobs, as the services would read them here

ROOT = Path(__file__).resolve().parents[1]

FIELDS = ("param", "exp_avg", "exp_avg_sq")

# figures only: compression is lossless by test, its ratio and speed are what they are
_CODECS = {"key": "[zp]*-[13]"}  # zstd-1, zstd-3, planes-1, planes-3: one thread each
GOALS = [
    Goal("persisted shard, {key}: ratio", "shard.*.ratio", None, unit="x", where=_CODECS),
    Goal("persisted shard, {key}: compress", "shard.*.compress_MBps", None, unit="MB/s", where=_CODECS),
    Goal("persisted shard, {key}: decompress", "shard.*.decompress_MBps", None, unit="MB/s", where=_CODECS),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--repeat", "3"]
ARGS_FULL = ["--repeat", "5"]
ARGS_SMOKE = ["--n-layer", "1", "--n-embd", "64", "--steps", "2", "--repeat", "1", "--levels", "1,3"]


def train(n_layer: int, n_embd: int, steps: int, batch: int) -> tuple[dict[str, np.ndarray], dict]:
    """The GPT of examples/gpt.py after ``steps`` AdamW steps: flat fp32 params and moments."""
    import torch

    GPT, CharData, GPTConfig, corpus = example_gpt()
    torch.manual_seed(0)
    data = CharData(corpus(4000))
    model = GPT(GPTConfig(vocab_size=len(data.chars), block_size=64, n_layer=n_layer, n_embd=n_embd))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    t0 = time.perf_counter()
    for it in range(steps):
        x, y = data.batch(it, 0, batch, 64)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    ps = [p for p in model.parameters()]
    out = {
        "param": torch.cat([p.detach().reshape(-1) for p in ps]),
        "exp_avg": torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ps]),
        "exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in ps]),
    }
    info = {
        "params": int(out["param"].numel()),
        "n_layer": n_layer,
        "n_embd": n_embd,
        "steps": steps,
        "batch": batch,
        "final_loss": float(loss),
        "train_s": time.perf_counter() - t0,
    }
    return {k: v.numpy().copy() for k, v in out.items()}, info


def shard_image(arrays: dict[str, np.ndarray]) -> shardfile.ShardImage:
    """The shard file a single worker holding the whole model writes (as ``writer.begin``)."""
    n = arrays["param"].size
    img = shardfile.ShardImage(3 * n * 4 + (1 << 20))
    entries = [shardfile.Entry(f, "F32", n) for f in FIELDS]
    entries += [
        shardfile.Entry("param_index", "I64", 64),
        shardfile.Entry("steps", "F64", 64),
        shardfile.Entry("has_state", "U8", 64),
        shardfile.Entry("commit.rank0", "U8", 200),
    ]
    img.layout(entries, {"format": shardfile.FORMAT, "job": "bench", "start": "0", "stop": str(n), "iteration": "40"})
    for f in FIELDS:
        img.fill(f, arrays[f])
    img.fill("param_index", np.arange(64, dtype=np.int64))
    img.fill("steps", np.full(64, 40.0))
    img.fill("has_state", np.ones(64, dtype=np.uint8))
    img.fill("commit.rank0", np.frombuffer(json.dumps({"iteration": 40, "tokens": None}).encode().ljust(200), np.uint8))
    return img


def blocks(raw: np.ndarray, block: int) -> list[np.ndarray]:
    return [raw[i : i + block] for i in range(0, raw.size, block)]


class Plain:
    """zstd on the bytes as they are, in the same blocks as the planes codec."""

    def __init__(self, level: int, threads: int = 0) -> None:
        self.c = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)
        self.d = zstandard.ZstdDecompressor()

    def compress(self, parts: list[np.ndarray]) -> list[bytes]:
        return [self.c.compress(p) for p in parts]

    def decompress(self, frames: list[bytes], out: np.ndarray) -> None:
        pos = 0
        for f in frames:
            n = zstandard.frame_content_size(f)
            with self.d.stream_reader(f) as r:
                r.readinto(memoryview(out[pos : pos + n]))
            pos += n


class Planes:
    def __init__(self, level: int, itemsize: int = 4) -> None:
        self.level, self.k = level, itemsize

    def compress(self, parts: list[np.ndarray]) -> list[bytes]:
        return [planes.encode(p, self.k, self.level) for p in parts]

    def decompress(self, frames: list[bytes], out: np.ndarray) -> None:
        pos = 0
        for f in frames:
            n = planes.peek(f)[1]
            planes.decode(f, out[pos : pos + n])
            pos += n


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def run_rounds(cases: dict, rounds: int) -> dict[str, list]:
    """``cases``: name -> callable returning a result dict of times; one warm-up round,
    then ``rounds`` rounds in a rotated order. Returns name -> list of result dicts."""
    names = list(cases)
    for n in names:
        cases[n]()
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            out[n].append(cases[n]())
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=512, help="6 x 512: 19M parameters")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--levels", default="1,3,9")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up (median)")
    ap.add_argument("--json", default="bench_compress.json")
    return ap


def run(args) -> dict:
    """Train, then every codec per field, the whole shard file and the interleave, the
    tables printed; the JSON document."""
    levels = [int(x) for x in args.levels.split(",")]
    t_start = time.perf_counter()
    info = machine_info()
    info["zstandard"] = zstandard.__version__
    arrays, model = train(args.n_layer, args.n_embd, args.steps, args.batch)
    block = TUNING.compress_block_bytes
    print(
        f"GPT {model['params'] / 1e6:.1f}M params after {args.steps} AdamW steps (loss {model['final_loss']:.3f}, "
        f"{model['train_s']:.0f} s); {os.cpu_count()} cores; blocks of {block >> 20} MiB; median of "
        f"{args.repeat} interleaved rounds"
    )
    raws = {f: arrays[f].view(np.uint8) for f in FIELDS}
    mb = {f: raws[f].nbytes / 1e6 for f in FIELDS}

    # --- per field: plain zstd vs planes + zstd ---
    codecs = {}
    for lvl in levels:
        codecs[f"zstd-{lvl}"] = Plain(lvl)
        codecs[f"planes-{lvl}"] = Planes(lvl)
    outs = {f: np.empty_like(raws[f]) for f in FIELDS}

    def field_case(f: str, codec):
        def case():
            parts = blocks(raws[f], block)
            tc, frames = timed(lambda: codec.compress(parts))
            td, _ = timed(lambda: codec.decompress(frames, outs[f]))
            if not np.array_equal(outs[f], raws[f]):
                raise AssertionError(f"{f}: round trip is not bit-exact")
            return {"compress_s": tc, "decompress_s": td, "stored": sum(map(len, frames))}

        return case

    cases = {f"{f}/{c}": field_case(f, codec) for f in FIELDS for c, codec in codecs.items()}
    res = run_rounds(cases, args.repeat)
    fields: dict = {f: {} for f in FIELDS}
    for key, runs in res.items():
        f, c = key.split("/")
        tc, td = statistics.median(r["compress_s"] for r in runs), statistics.median(r["decompress_s"] for r in runs)
        fields[f][c] = {
            "ratio": raws[f].nbytes / runs[0]["stored"],
            "compress_MBps": mb[f] / tc,
            "decompress_MBps": mb[f] / td,
            "stored_bytes": runs[0]["stored"],
            "compress_s": [r["compress_s"] for r in runs],
            "decompress_s": [r["decompress_s"] for r in runs],
        }

    # per-plane ratios (planes codec, one block of each field)
    per_plane = {}
    for f in FIELDS:
        per_plane[f] = {}
        for lvl in levels:
            blob = planes.encode(raws[f][:block], 4, lvl)
            lengths = np.frombuffer(blob, dtype="<u8", count=4, offset=planes.HEADER_SIZE)
            per_plane[f][lvl] = [round(min(block, raws[f].size) / 4 / int(x), 3) for x in lengths]

    # --- the whole shard file, through zshard (the worker's and restore's code path) ---
    img = shard_image(arrays)
    image = img.buf[: img.size]
    shard_mb = img.size / 1e6
    target_bufs: dict = {}

    def target(name, dtype, count):
        arr = target_bufs.get(name)
        if arr is None or arr.size != count:
            arr = target_bufs[name] = np.empty(count, dtype=dtype)
        return arr

    def shard_case(lvl: int, threads: int, dthreads: int):
        def case():
            buf = io.BytesIO()
            tc, _ = timed(lambda: zshard.encode(image, buf, lvl, threads=threads))
            data = buf.getvalue()
            td, _ = timed(lambda: zshard.decode(data, target, threads=dthreads))
            return {"compress_s": tc, "decompress_s": td, "stored": len(data)}

        return case

    def shard_plain(lvl: int, threads: int = 0):
        codec = Plain(lvl, threads)
        out = np.empty_like(image)

        def case():
            parts = blocks(image, block) if threads == 0 else [image]
            tc, frames = timed(lambda: codec.compress(parts))
            td, _ = timed(lambda: codec.decompress(frames, out))
            return {"compress_s": tc, "decompress_s": td, "stored": sum(map(len, frames))}

        return case

    shard_cases = {}
    for lvl in levels:
        shard_cases[f"zstd-{lvl}"] = shard_plain(lvl)
        shard_cases[f"planes-{lvl}"] = shard_case(lvl, 1, 1)
    mid = 3 if 3 in levels else levels[0]
    shard_cases[f"planes-{mid} 2 threads"] = shard_case(mid, 2, 2)
    shard_cases["planes-1 2 threads"] = shard_case(1, 2, 2)
    shard_cases[f"zstd-{mid} zstd-mt 2"] = shard_plain(mid, threads=2)
    res = run_rounds(shard_cases, args.repeat)
    for lvl in levels:  # the file round trip is bit-exact
        buf = io.BytesIO()
        zshard.encode(image, buf, lvl)
        rebuilt = io.BytesIO()
        zshard.decode_to(buf.getvalue(), rebuilt)
        if rebuilt.getvalue() != bytes(image):
            raise AssertionError(f"level {lvl}: the rebuilt shard file differs")
    shard: dict = {}
    for key, runs in res.items():
        tc, td = statistics.median(r["compress_s"] for r in runs), statistics.median(r["decompress_s"] for r in runs)
        shard[key] = {
            "ratio": img.size / runs[0]["stored"],
            "compress_MBps": shard_mb / tc,
            "decompress_MBps": shard_mb / td,
            "stored_bytes": runs[0]["stored"],
            "compress_s": [r["compress_s"] for r in runs],
            "decompress_s": [r["decompress_s"] for r in runs],
        }

    # --- byte-plane (de)interleave: numba kernels vs numpy transposes ---
    raw = raws["param"]
    pl = np.empty((4, raw.size // 4), dtype=np.uint8)
    back = np.empty_like(raw)

    def np_split():
        pl[...] = raw.reshape(-1, 4).T

    def np_join():
        back.reshape(-1, 4)[...] = pl.T

    inter_cases = {
        "split numba": lambda: timed(lambda: planes.split(raw, 4, pl))[0],
        "split numpy": lambda: timed(np_split)[0],
        "join numba": lambda: timed(lambda: planes.join(pl, back))[0],
        "join numpy": lambda: timed(np_join)[0],
    }
    res = run_rounds(inter_cases, max(args.repeat, 5))
    interleave = {k: {"MBps": mb["param"] / statistics.median(v), "s": v} for k, v in res.items()}

    # --- print ---
    print(f"\nper field ({', '.join(f'{f} {mb[f]:.0f} MB' for f in FIELDS)}): ratio | compress MB/s | decompress MB/s")
    print(f"| {'codec':10s} | " + " | ".join(f"{f:^26s}" for f in FIELDS) + " |")
    for c in codecs:
        cells = [
            f"{fields[f][c]['ratio']:5.3f} {fields[f][c]['compress_MBps']:7.0f} {fields[f][c]['decompress_MBps']:7.0f}"
            for f in FIELDS
        ]
        print(f"| {c:10s} | " + " | ".join(f"{x:^26s}" for x in cells) + " |")
    print("\nplanes codec, ratio of each byte plane (0 = lowest mantissa byte, 3 = sign + exponent):")
    for f in FIELDS:
        print(f"  {f:11s} " + "  ".join(f"L{lvl}: {per_plane[f][lvl]}" for lvl in levels))
    print(f"\nwhole shard file ({shard_mb:.0f} MB: 3 fields + metadata) through zshard:")
    print(f"| {'codec':22s} | {'ratio':>6s} | {'compress MB/s':>13s} | {'decompress MB/s':>15s} |")
    for k, v in shard.items():
        print(f"| {k:22s} | {v['ratio']:6.3f} | {v['compress_MBps']:13.0f} | {v['decompress_MBps']:15.0f} |")
    print(
        "\nbyte-plane interleave of param (MB/s): " + ", ".join(f"{k} {v['MBps']:.0f}" for k, v in interleave.items())
    )
    out = {
        "machine": info,
        "model": model,
        "block_bytes": block,
        "rounds": args.repeat,
        "levels": levels,
        "fields": fields,
        "per_plane_ratio": per_plane,
        "shard": shard,
        "shard_bytes": img.size,
        "interleave": interleave,
        "wall_s": time.perf_counter() - t_start,
    }
    return out


def plot(results: dict, path) -> bool:
    """Compression ratio of the whole shard file per codec (no better plot: the speeds are
    in the table)."""
    shard = results["shard"]
    return bars(path, list(shard), [v["ratio"] for v in shard.values()], "Persisted shard, lossless", "ratio")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
