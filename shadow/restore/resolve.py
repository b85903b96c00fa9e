"""Finding the checkpoint to restore: shadow memory first, then the local tier, then the
remote tier; or straight from a directory / fsspec URL."""

from __future__ import annotations

import logging
import time

import zmq

from shadow import knobs
from shadow.client import dealer, request
from shadow.errors import ShadowError
from shadow.persist import checkpoints
from shadow.restore.snapshot import MovedOn, fetch_memory
from shadow.snapshot import Snapshot
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


def is_endpoint(source: str) -> bool:
    return source.startswith(("tcp://", "ipc://", "inproc://"))


def restore_info(address: str, job: str | None, timeout: float) -> dict:
    sock = dealer(zmq.Context.instance(), address)
    try:
        return request(sock, address, M.encode("restore_info", job=job), timeout, ("restore_info_reply",))["info"]
    finally:
        sock.close(linger=0)


def resolve(
    source: str,
    job: str | None = None,
    iteration: int | None = None,
    timeout: float | None = None,
    attempts: int = 5,
    progress=None,
) -> Snapshot:
    """The checkpoint to restore from ``source`` (newest complete, or ``iteration``).

    ``progress(done_bytes, total_bytes)`` is called as shards arrive, if given."""
    timeout = knobs.get("CONNECT_TIMEOUT_S") if timeout is None else timeout
    if not is_endpoint(source):
        tier = "remote" if "://" in source else "local"  # a URL names a remote copy; a path, a local dir
        return checkpoints.find(source, tier, job, iteration, progress=progress)[1]
    errors = []
    for attempt in range(attempts):
        info = restore_info(source, job, timeout)
        mem = info["memory"]
        if mem is None:
            errors.append(f"memory: {info['memory_error']}")
            break
        if iteration is not None and mem["iteration"] != iteration:
            errors.append(f"memory: holds iteration {mem['iteration']}, not {iteration}")
            break
        try:
            return fetch_memory(mem, source, progress)
        except MovedOn as exc:  # training is live and moved on: take the newer cut
            logger.info("restore raced a live cluster (%s); retrying", exc)
            time.sleep(0.05 * (attempt + 1))
        except ShadowError as exc:
            errors.append(f"memory: {exc}")
            break
    else:
        errors.append(f"memory: the cluster kept moving on during {attempts} attempts")
    job = job or info.get("job")
    for st in info["storage"]:
        try:
            snap = checkpoints.find(st["root"], st["tier"], job, iteration, progress=progress)[1]
            logger.info("restoring from the %s tier (%s): %s", st["tier"], st["root"], "; ".join(errors))
            return snap
        except checkpoints.CheckpointError as exc:
            errors.append(f"{st['tier']}: {exc}")
        except Exception as exc:  # an unreachable remote tier
            errors.append(f"{st['tier']}: {type(exc).__name__}: {exc}")
    raise ShadowError(f"no restorable checkpoint behind {source}: " + "; ".join(errors))
