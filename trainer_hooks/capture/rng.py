"""Capture and restore of every RNG a training loop draws from, per rank."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    """torch CPU (and CUDA when present), Python ``random`` and numpy's global RNG."""
    np_state = np.random.get_state()  # the legacy tuple of numpy's global RandomState (an MT19937)
    if not isinstance(np_state, tuple):
        raise TypeError(f"numpy's global RNG state is a {type(np_state).__name__}, not MT19937's tuple")
    out = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state[0],
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["bit_generator"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
