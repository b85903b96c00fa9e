"""The coordinator's ``configure`` at a worker: the checks made before anything is
allocated (:func:`configure_problem`), whether the old epoch's state can be kept at the new
base (:func:`keeps`), and :class:`Configure`, which builds the new
:class:`~shadow.worker.assignment.Assignment` and retires the old one. Imports no torch."""

from __future__ import annotations

import logging

from shadow.config.tuning import Tuning
from shadow.core import sqrttab
from shadow.core.layout import Layout
from shadow.core.sizing import human, nfields, session_bytes
from shadow.kernels import powtab
from shadow.worker import memory
from shadow.worker.assignment import Assignment
from shadow.worker.fetches import FetchServer
from shadow.worker.files import FileServer
from shadow.worker.outbox import Outbox
from shadow.worker.peer import PeerCopy
from shadow.worker.state import WorkerState

logger = logging.getLogger(__name__)


def configure_problem(msg: dict, tuning: Tuning | None = None) -> str | None:
    """What makes a ``configure`` impossible to carry out here, checked before
    anything is allocated: a range outside the layout, or more memory than is free."""
    layout = Layout.from_dict(msg["layout"])
    start, stop = msg["start"], msg["stop"]
    if not 0 <= start <= stop <= layout.total:
        return f"range [{start}, {stop}) is outside the layout's {layout.total} elements"
    if not 1 <= msg["world"] <= 1 << 20:
        return f"world size {msg['world']} is out of bounds"
    pow_problem = powtab.check_entries(msg["optim"].get("pow"))
    if pow_problem is None and "sqrt" in msg["optim"]:
        pow_problem = sqrttab.check(msg["optim"]["sqrt"])
    if pow_problem is not None:
        return f"the replay descriptor is malformed: {pow_problem}"
    persist = msg["persist"]
    local = isinstance(persist, dict) and isinstance(persist.get("local"), dict) and bool(persist["local"].get("dir"))
    need = session_bytes(stop - start, nfields(msg["optim"]), len(layout.params), local, tuning or Tuning.load())
    free = memory.available_bytes()
    if 0 <= free < need:
        return (
            f"the range [{start}, {stop}) needs {human(need)} and this worker has "
            f"{human(free)} free; add workers, or free memory on this host"
        )
    return None


def keeps(old: Assignment | None, msg: dict) -> bool:
    """Whether a ``configure`` offering to keep epoch ``msg["keep"]``'s state finds it here
    as the new epoch needs it: that epoch, applied through exactly the new base, not stale,
    and the same job, layout, range, world and optimizer."""
    keep = msg.get("keep")
    return (
        type(keep) is int
        and old is not None
        and old.epoch == keep
        and not old.stale
        and old.applied == msg["iteration"]
        and old.job == msg["job"]
        and old.world == msg["world"]
        and (old.state.start, old.state.stop) == (msg["start"], msg["stop"])
        and old.config["layout"] == msg["layout"]
        and old.config["optim"] == msg["optim"]
    )


class Configure:
    """Carries out the coordinator's ``configure`` on ``state``: the new assignment, or
    ``stale`` to the coordinator (through ``outbox``) where it cannot be carried out. Tells
    ``files`` where the local tier is, lets ``fetches`` answer from the retired epoch, and
    starts a copy from a peer through ``peer`` where the coordinator names one.
    ``data_mode``: the worker's data socket's (``plain``, ``mac`` or ``curve``), which a
    configure's data key must match. Owned by the worker's main thread."""

    def __init__(
        self,
        state: WorkerState,
        outbox: Outbox,
        files: FileServer,
        fetches: FetchServer,
        peer: PeerCopy,
        data_mode: str,
    ) -> None:
        self.state, self.outbox, self.files, self.fetches, self.peer = state, outbox, files, fetches, peer
        self.data_mode = data_mode

    def carry_out(self, msg: dict) -> None:
        """Configure the epoch of ``msg`` (checked first: on a problem the old epoch stays
        and the coordinator hears ``stale``), keeping the old assignment's state where it
        is offered and held as needed, then copy from a peer or report ``configured``."""
        st = self.state
        try:
            problem = configure_problem(msg, st.tuning)
            if problem is None and (msg.get("data_key") is None) != (self.data_mode == "plain"):
                problem = (
                    f"configure {'without' if self.data_mode != 'plain' else 'with'} a data key, and this "
                    f"worker's data socket is {self.data_mode}: the coordinator and the workers must both "
                    "have keys (security.server_key) or neither"
                )
            if problem is not None:
                raise ValueError(problem)
            old = st.assignment
            keep = old.state if old is not None and keeps(old, msg) else None
            sess = Assignment(msg, st.tuning, self.files.override, keep=keep)
        except (ValueError, KeyError, TypeError, OverflowError, MemoryError) as exc:
            logger.error("cannot configure epoch %s: %s", msg.get("epoch"), exc)
            self.outbox.to_coord("stale", epoch=msg["epoch"], reason=f"configure failed: {exc}")
            return
        # anything in flight for the old epoch is void
        st.retired = old if old is not None and old.applied >= 0 and not old.stale and msg["peer"] is None else None
        st.assignment = sess
        if old is not None:  # its persister would otherwise live on, with its threads and images
            old.close()
        st.configures += 1
        if sess.persister is not None:  # where this worker's local tier is, for the files socket
            self.files.learn(sess.persister.local, sess.persister.file_mode, sess.persister.dir_mode)
        self.fetches.answer()  # waiting fetches of the old epoch get an answer from the retired copy
        self.peer.cancel()  # a peer copy of the old epoch is void too
        if msg["peer"] is not None:
            self.peer.start(msg["peer"])
            return
        st.awaiting_copy = False
        logger.info(
            "configured epoch %d job %s: range [%d, %d) of %d, world %d, from iteration %d%s",
            sess.epoch,
            sess.job,
            sess.state.start,
            sess.state.stop,
            sess.layout.total,
            sess.world,
            sess.base,
            f" (keeping epoch {old.epoch}'s state at it)" if sess.kept and old is not None else "",
        )
        self.outbox.to_coord("configured", epoch=sess.epoch, **({"kept": True} if sess.kept else {}))
