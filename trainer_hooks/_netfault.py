"""Network fault injection on the trainer's data sockets (tests and the fault matrix).

``SHADOW_FAULT_NET="drop=0.02,dup=0.02,reorder=0.02,truncate=0.02,bitflip=0.02,seed=7,until=30"``
makes each data message (GRAD, STATE or COMMIT, to one worker) of iterations in
``[from, until)`` suffer at most one fault, drawn with the given probabilities from a
generator seeded by ``seed`` and the rank (with ``cover=1``, the first faults drawn go
through every listed kind once, rank r starting at the (2r)-th kind, so that even a short
run in which each of two ranks draws three faults sees every kind):

* drop      -- never sent (its sequence number is used: the worker sees a gap);
* dup       -- sent twice (the worker drops the second copy by sequence number);
* reorder   -- held back and sent after the next message to the same worker;
* truncate  -- the last frame of the message is left off (or the header is cut short);
* bitflip   -- one random bit of one random frame (header, run table or payload) flipped.
"""
from __future__ import annotations

import logging
import random
from collections import Counter

import zmq

logger = logging.getLogger(__name__)

KINDS = ("drop", "dup", "reorder", "truncate", "bitflip")


_ACTIVE: dict[tuple[str, int], "NetFaults"] = {}  # one draw sequence per process, across resyncs


def parse(spec: str | None, rank: int) -> "NetFaults | None":
    if not spec:
        return None
    if (spec, rank) in _ACTIVE:
        return _ACTIVE[spec, rank]
    probs, seed, span, cover = {}, 0, [0, 1 << 62], False
    for item in spec.split(","):
        key, _, value = item.strip().partition("=")
        if key == "seed":
            seed = int(value)
        elif key == "cover":
            cover = bool(int(value))
        elif key in ("from", "until"):
            span[key == "until"] = int(value)
        elif key in KINDS:
            probs[key] = float(value)
        else:
            raise ValueError(f"SHADOW_FAULT_NET: unknown fault {key!r}; use {', '.join(KINDS)}, seed, from, until, "
                             "cover")
    if sum(probs.values()) > 1.0:
        raise ValueError(f"SHADOW_FAULT_NET: probabilities add up to more than 1 ({spec})")
    _ACTIVE[spec, rank] = NetFaults(probs, seed * 1000 + rank, tuple(span), cover, 2 * rank)
    return _ACTIVE[spec, rank]


class NetFaults:
    def __init__(self, probs: dict[str, float], seed: int, span: tuple[int, int] = (0, 1 << 62),
                 cover: bool = False, first: int = 0) -> None:
        self.probs, self.span, self.cover = probs, span, cover
        kinds = [k for k in probs if probs[k] > 0]
        self.order = kinds[first % len(kinds):] + kinds[:first % len(kinds)] if kinds else []
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.held: dict[int, list] = {}  # worker -> frames held back for reordering

    def send(self, sock: zmq.Socket, worker: int, frames: list, track: bool, iteration: int):
        """Send ``frames`` through the fault model; returns a tracker or None (done)."""
        x, kind = self.rng.random(), None
        for name, p in self.probs.items() if self.span[0] <= iteration < self.span[1] else ():
            if x < p:
                kind = name
                break
            x -= p
        if kind is not None and self.cover:
            kind = next((k for k in self.order if not self.injected[k]), kind)
        held = self.held.pop(worker, None)
        tracker = None
        if kind is None:
            tracker = sock.send_multipart(frames, copy=not track, track=track)
        else:
            self.injected[kind] += 1
            copies = [bytes(f) for f in frames]
            if kind == "dup":
                sock.send_multipart(copies)
                sock.send_multipart(copies)
            elif kind == "reorder":
                self.held[worker] = copies
            elif kind == "truncate":
                sock.send_multipart(copies[:-1] if len(copies) > 1 else [copies[0][:len(copies[0]) // 2]])
            elif kind == "bitflip":
                i = self.rng.randrange(len(copies))
                frame = bytearray(copies[i])
                if frame:
                    bit = self.rng.randrange(len(frame) * 8)
                    frame[bit // 8] ^= 1 << (bit % 8)
                copies[i] = bytes(frame)
                sock.send_multipart(copies)
            logger.warning("fault injection: %s of a data message to worker %d", kind, worker)
        if held is not None:
            sock.send_multipart(held)
        return tracker
