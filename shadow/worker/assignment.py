"""What a worker holds for one attach epoch: its assigned shard of one job.

The coordinator's ``configure`` message makes one; it lives until the next epoch's replaces
it (then it is ``Worker.retired`` until the new one has its base) or the worker resets.
Imports no torch."""

from __future__ import annotations

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.core.layout import Layout
from shadow.persist.writer import ShardPersister
from shadow.transport.receive import Context
from shadow.wire import tags
from shadow.worker.inbox import Inbox
from shadow.worker.shard import ShardState


class Assignment:
    """The job, epoch, shard range and state a ``configure`` message assigns, the inbox of
    iterations in flight, and how far they got (prepared, applied, stale)."""

    def __init__(
        self, msg: dict, tuning: Tuning | None = None, local_dir: str = "", keep: ShardState | None = None
    ) -> None:
        """``local_dir``: this worker's own directory for the local tier (node-local), which
        takes the place of the cluster's ``persist.local.dir`` when the tier is on. ``keep``:
        the previous epoch's state, already at this epoch's base (``configure``'s ``keep``),
        whose arrays this one shares until a rank sends STATE frames after all
        (:meth:`unkeep`); the ranks prove it equal to theirs by digests instead."""
        tuning = tuning if tuning is not None else Tuning.load()
        self.config = {k: v for k, v in msg.items() if k != "keep"}  # sent back if the coordinator restarts (rejoin)
        self.epoch = msg["epoch"]
        self.job = msg["job"]
        self.job_id = msg["job_id"]
        self.layout = Layout.from_dict(msg["layout"])
        self.layout_hash = self.layout.hash
        self.world = msg["world"]
        self.base = msg["iteration"]
        self.kept = keep is not None
        self.state = (
            keep.sharing()
            if keep is not None
            else ShardState(self.layout, msg["start"], msg["stop"], msg["optim"], tuning.kernel_chunk_elements)
        )
        self.context = Context(
            self.job_id,
            self.epoch,
            self.layout_hash,
            self.world,
            self.state.start,
            self.state.stop,
            frozenset(self.state.fields()),
            tags.for_ranks(msg.get("data_key"), self.world),
        )  # what a data message must match (with keys: each rank's MAC key of this configuration)
        # what the fetch tickets of this configuration derive from (a keyed cluster; None without keys)
        self.serve_key = tags.serve_key(msg["data_key"]) if msg.get("data_key") else None
        self.exact = bool(msg["optim"].get("bit_exact", True))
        self.inbox = Inbox(
            self.state.size, self.world, tuning.worker_slots, self.state.expected_grad, self.state.fields()
        )
        self.applied = -1  # nothing installed yet
        self.prepared = self.base - 1  # highest iteration reported PREPARED
        self.seen = self.base - 1
        self.blobs: dict[int, bytes] = {}  # rank -> commit blob of the applied iteration
        self.extras: dict = {}  # key -> newest chunk of model state outside the optimizer, as of applied
        self.commit: dict | None = None  # rank 0's replay record of the applied iteration
        self.stale: str | None = None
        persist = PersistConfig.from_dict(msg["persist"])  # the cluster's typed config, rebuilt
        if local_dir and persist.local.enabled:
            persist.local.dir = local_dir
        generation = int(msg["persist"].get("generation", 0))  # the job's lineage, beside the config
        self.persister = (
            ShardPersister(persist, self.job, msg["shard"], msg["shards"], self.state, generation, tuning)
            if persist.local.enabled
            else None
        )

    def unkeep(self) -> None:
        """A rank sends its state after all (STATE frames): this epoch takes it into arrays of
        its own, leaving the kept ones to the previous epoch (which may still serve them)."""
        if self.kept:
            self.state.fresh_arrays()
            self.kept = False

    def close(self) -> None:
        """Stop persisting (the session is replaced, dropped or the worker stops): the
        persister's threads end and its images go; the state stays for serving."""
        if self.persister is not None:
            self.persister.close()
            self.persister = None
