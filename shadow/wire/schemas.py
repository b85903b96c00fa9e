"""The control messages' schemas: each type's fields and their accepted types, the fields a
sender may leave out, the error codes, and which types each kind of socket receives. Data
only; :mod:`shadow.wire.messages` encodes, limits and checks messages against it."""

from __future__ import annotations

VERSION = 1

_num = (int, float)
# type -> {field: accepted python types}
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # worker -> coordinator
    "starting": {"pid": (int,), "worker_id": (int,), "seconds": (float, int)},  # compiling its kernels
    "register": {"data": (str,), "serve": (str,), "pid": (int,), "worker_id": (int,), "memory": (int,)},
    "configured": {"epoch": (int,)},
    "rejoin": {
        "data": (str,),
        "serve": (str,),
        "pid": (int,),
        "worker_id": (int,),
        "assignment": (dict, type(None)),
        "memory": (int,),
    },  # memory: bytes the worker has free (-1: unknown)
    "prepared": {"epoch": (int,), "iteration": (int,), "tokens": (int, type(None))},
    "persisted": {
        "epoch": (int,),
        "iteration": (int,),
        "tier": (str,),
        "shard": (int,),
        "ok": (bool,),
        "error": (str,),
        "file": (str,),
        "start": (int,),
        "stop": (int,),
        "bytes": (int,),
        "checksum": (str,),
        "seconds": (float, int),
        "commit": (dict, type(None)),
        "blob_ranks": (list,),
    },
    "stale": {"epoch": (int,), "reason": (str,)},
    "copied": {"epoch": (int,), "iteration": (int,), "seconds": (float, int)},
    "audited": {
        "epoch": (int,),
        "iteration": (int,),
        "ok": (bool,),
        "checked": (int,),
        "max_ulp": (int,),
        "first_param": (str,),
        "detail": (str,),
    },
    "heartbeat": {
        "epoch": (int,),
        "applied": (int,),
        "seen": (int,),
        "rejected": (dict,),
        "frames_in": (int,),
        "bytes_in": (int,),
        "stale": (str,),
        "seq": (list,),
        "replay_s": (float, int),
        "replayed": (int,),
        "memory": (int,),
    },
    # coordinator -> worker
    "registered": {"worker_id": (int,), "awaiting_copy": (bool,)},
    "reset": {"reason": (str,)},
    "reregister": {},
    "configure": {
        "epoch": (int,),
        "job": (str,),
        "job_id": (int,),
        "layout": (dict,),
        "start": (int,),
        "stop": (int,),
        "world": (int,),
        "optim": (dict,),
        "iteration": (int,),
        "persist": (dict,),
        "shard": (int,),
        "shards": (int,),
        "peer": (dict, type(None)),
    },
    "upload": {"epoch": (int,), "iteration": (int,), "bytes": (int,), "checksum": (str,)},
    "forget": {"job": (str,), "dirs": (list,)},  # checkpoint directories retention dropped
    "apply": {"epoch": (int,), "iteration": (int,), "persist": (bool,)},
    # trainer -> coordinator
    "attach": {
        "job": (str,),
        "rank": (int,),
        "world": (int,),
        "layout_hash": (int,),
        "layout": (dict, type(None)),
        "optim": (dict,),
        "iteration": (int,),
        "overwrite": (bool,),
        "restored": (dict, type(None)),
    },  # the checkpoint this rank restored (job, iteration, generation, tier, path)
    "detach": {"epoch": (int,), "rank": (int,)},
    "replica_from": {"epoch": (int,), "rank": (int,), "worker": (int,), "gen": (int,), "iteration": (int,)},
    "lagging": {"epoch": (int,), "rank": (int,), "iteration": (int,), "applied": (int,)},
    "paused": {"epoch": (int,), "rank": (int,), "reason": (str,)},  # a rank stopped streaming on its own
    "trainer_hb": {"epoch": (int,), "rank": (int,), "world": (int,), "job_id": (int,), "seq": (list,)},
    # coordinator -> trainer
    "attached": {"epoch": (int,), "job_id": (int,), "workers": (list,)},
    "waiting": {"ready": (int,), "expected": (int,), "starting": (int,)},  # attach held: workers still starting
    "progress": {"epoch": (int,), "applied": (int,)},
    "alive": {"epoch": (int,)},  # the answer to every trainer_hb: a trainer that hears nothing is on its own
    "degraded": {"epoch": (int,), "reason": (str,)},
    "resync": {"epoch": (int,)},
    "replica_out": {"epoch": (int,), "worker": (int,)},
    "replica_in": {"epoch": (int,), "worker": (int,), "data": (str,), "gen": (int,)},
    "audit": {"epoch": (int,), "iteration": (int,), "ok": (bool,), "detail": (str,)},
    # anyone -> coordinator
    "status": {},
    "restore_info": {"job": (str, type(None))},
    "catalog": {"tier": (str,), "job": (str, type(None))},  # a tier's manifests, as the coordinator keeps them
    # clients and admins -> coordinator: the jobs the cluster knows (shadow jobs)
    "jobs": {},
    # admins -> coordinator: detach job ``job`` whose trainers are gone (``force``: even if they are heard from)
    "drop": {"job": (str,), "force": (bool,)},
    # coordinator -> anyone
    "status_reply": {"status": (dict,)},
    "restore_info_reply": {"info": (dict,)},
    # checkpoints: [[directory (job/iteration-k), manifest.json's bytes, superseded], ...]; torn: directories
    "catalog_reply": {"root": (str,), "checkpoints": (list,), "torn": (list,)},
    # jobs: one map per job (shadow.coordinator.jobs.jobs_view), the held job first
    "jobs_reply": {"jobs": (list,), "window_s": (float, int)},
    # the job detached, the epoch and committed iteration it keeps, whether it was forced, what happened
    "drop_reply": {
        "job": (str,),
        "epoch": (int,),
        "committed": (int, type(None)),
        "forced": (bool,),
        "message": (str,),
    },
    "error": {"message": (str,), "code": (str,)},  # code: one of ERROR_CODES, for callers to act on
    # a shared cluster's front -> anyone: job ``job`` is served by the coordinator at ``to``; ask it there
    "moved": {"job": (str,), "to": (str,)},
    # a shared cluster's agent -> its front, every second: the host it runs jobs on (its name,
    # the address its jobs' coordinators are reached at, the bytes and cores it gives jobs, the
    # cores each job is pinned to) and each job it runs: {"job", "port", "pid", "exited" (its
    # cluster's exit status or None), "report" (its coordinator's report or None)}
    "agent": {
        "name": (str,),
        "host": (str,),
        "memory": (int,),
        "cores": (int,),
        "cores_per_job": (int,),
        "jobs": (list,),
    },
    # a front -> an agent, in answer: every job the agent is to run ({"job", "workers",
    # "replicas", "last": its last iteration to the local tier, its memory is wanted})
    "agent_jobs": {"jobs": (list,)},
    # client -> worker serve socket
    "fetch": {"epoch": (int,), "iteration": (int,)},
    # client -> worker files socket: a shard file of the worker's local tier, and its head (the
    # file follows in messages of ``chunk`` bytes)
    "read_file": {"job": (str,), "dir": (str,), "file": (str,), "bytes": (int,)},
    "file_reply": {"bytes": (int,), "chunk": (int,)},
    # worker -> client; optional "extras": [[key, nbytes, xxh3], ...], chunks of the model state
    # outside the optimizer, sent after the arrays' chunks
    "fetch_reply": {
        "epoch": (int,),
        "iteration": (int,),
        "start": (int,),
        "stop": (int,),
        "arrays": (list,),
        "steps": (list,),
        "has_state": (list,),
        "commits": (list,),
        "replay": (dict, type(None)),
        "chunk": (int,),
        "sums": (list,),
    },
    # worker -> client in mac mode (shadow.wire.tags): a fetch_reply, encoded, in ``head``,
    # whose ``sums`` and extras entries hold 16-byte GMAC tags; ``tag``: the head's own,
    # under the key of the fetch's ticket and ``salt``
    "fetch_reply_mac": {"salt": (bytes,), "tag": (bytes,), "head": (bytes,)},
}

# what an "error" reply's ``code`` says, so that a caller acts on it without reading the text:
# malformed (the request did not decode or check), refused (valid, but not accepted: a bad
# job name, a rank out of range, no slot for another worker, a type this service does not
# take), busy (a limit is reached: ask again later), moved_on (the iteration asked for has been
# applied past), wrong_epoch (another epoch is served), timeout (what was waited for did not
# come in time), internal (the service failed on it and dropped it)
ERROR_CODES = ("malformed", "refused", "busy", "moved_on", "wrong_epoch", "timeout", "internal")

# type -> {field: accepted python types}: fields a sender may leave out (checked when present)
OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    # chunks of the model state outside the optimizer: [[key, nbytes, xxh3], ...]; the element
    # ranges of the shard it carries when the fetch asked for some
    "fetch_reply": {"extras": (list,), "ranges": (list,)},
    # mac mode: the ticket the coordinator handed out for this worker, and the request's MAC
    # under its key (shadow.wire.tags.fetch_mac); any mode: ranges, [[start, stop], ...] of
    # the worker's shard to send (shadow.transport.fetch.check_ranges), instead of all of it
    "fetch": {"ticket": (bytes,), "mac": (bytes,), "ranges": (list,)},
    # mac mode: a ticket for the worker's files socket, the client's fresh nonce and the
    # request's MAC (shadow.wire.tags.file_mac); the reply's salt, each chunk then coming
    # as two frames, its GMAC tag and its bytes
    "read_file": {"ticket": (bytes,), "nonce": (bytes,), "mac": (bytes,)},
    "file_reply": {"salt": (bytes,)},
    # shadow.persist.writer.Persister.report: bytes before compression, the codec, and a
    # request skipped because every image was still being written (not a failure)
    "persisted": {"raw_bytes": (int,), "compress": (str,), "skipped": (bool,), "disk": (dict,)},
    # a worker's files socket and the disk of its local tier (shadow.worker.files)
    "heartbeat": {"files": (str,), "disk": (dict, type(None))},
    # data_mode: how the worker's data socket takes frames: plain (no keys), mac or curve
    # files_key (mac mode): what the tickets for its files socket derive from (drawn at its start)
    # slot_token: the token of the slot it names (shadow.worker.slot), from that slot's registered
    "register": {
        "files": (str,),
        "disk": (dict, type(None)),
        "data_mode": (str,),
        "files_key": (bytes,),
        "slot_token": (bytes,),
    },
    "rejoin": {
        "files": (str,),
        "disk": (dict, type(None)),
        "data_mode": (str,),
        "files_key": (bytes,),
        "slot_token": (bytes,),
    },
    # a keyed cluster's data key for this configuration (shadow.wire.tags): each rank's MAC key
    # for the worker derives from it
    "configure": {"data_key": (bytes,), "rank_secret": (bytes,), "keep": (int,)},
    # keep (configure): the epoch whose state, at the new epoch's base, the worker may keep
    # instead of taking it from the ranks' STATE frames (they prove theirs equal by digests);
    # kept (configured): it did
    "configured": {"kept": (bool,)},
    # a keyed cluster: this rank's MAC key for each worker, in worker order (each worker map
    # names its data socket's "mode"); took_over: this epoch took over a run that never
    # detached (its epoch and generation)
    "attached": {"keys": (list,), "token": (bytes,), "took_over": (str,), "keep": (bool,)},
    # "owner": a rank re-attaching its own live job (a resync): the epoch it leaves and its
    # token of that epoch; "launch": the launcher's run and restart round (an elastic
    # launcher's next round takes over its own run's job at once); "keep": the rank can prove
    # its state equal to what the workers hold by digests (a restore from the cluster's memory)
    "attach": {"owner": (dict,), "launch": (dict,), "keep": (bool,)},
    # why an attach is held besides workers starting (a live run owns the job)
    "waiting": {"reason": (str,)},
    # the job whose status is asked (a shared cluster's front answers with that job's coordinator)
    "status": {"job": (str,)},
    # the host the job's coordinator runs on, when it is not the front's (an agent's)
    "moved": {"host": (str,)},
    # the token of the rank's attached: a heartbeat from another connection must carry it
    "trainer_hb": {"token": (bytes,)},
    "replica_in": {"key": (bytes,), "mode": (str,)},
    # the cluster's persist.local.dir, where a worker without its own local_dir keeps its shards
    "registered": {"local_dir": (str,), "slot_token": (bytes,)},
    # older checkpoints the catalog left out (its manifests would not fit)
    # and the job's generation records, [[path under the root, bytes], ...], for the client to
    # check with its own manifest key (shadow.persist.generations.records_of)
    "catalog_reply": {"left_out": (int,), "generations": (list,)},
    # jobs known only from the tiers that the reply left out (it would not fit)
    "jobs_reply": {"left_out": (int,)},
}

#: The message types each kind of socket receives, for its ``ZMQ_MAXMSGSIZE``
#: (:func:`socket_limit`).
RECEIVES: dict[str, tuple[str, ...]] = {
    # the coordinator's ROUTER
    "coordinator": (
        "starting",
        "register",
        "configured",
        "rejoin",
        "prepared",
        "persisted",
        "stale",
        "copied",
        "audited",
        "heartbeat",
        "attach",
        "detach",
        "replica_from",
        "lagging",
        "paused",
        "trainer_hb",
        "status",
        "restore_info",
        "catalog",
        "jobs",
        "drop",
    ),
    # a shared cluster's front (its ROUTER): what a coordinator receives, and its agents
    "front": ("attach", "detach", "status", "restore_info", "catalog", "jobs", "drop", "agent"),
    # an agent's DEALER to its front
    "agent": ("agent_jobs", "error"),
    # a worker's DEALER to the coordinator
    "worker": ("registered", "reset", "reregister", "configure", "upload", "forget", "apply", "error"),
    # a worker's serve ROUTER
    "serve": ("fetch",),
    # a worker's files ROUTER
    "files": ("read_file",),
    # a client's DEALER (trainer ranks, CLI, restore, a replica copying from its peer)
    "client": (
        "attached",
        "waiting",
        "progress",
        "alive",
        "degraded",
        "resync",
        "replica_out",
        "replica_in",
        "audit",
        "status_reply",
        "restore_info_reply",
        "catalog_reply",
        "jobs_reply",
        "drop_reply",
        "error",
        "moved",
        "fetch_reply",
        "fetch_reply_mac",
        "file_reply",
    ),
}
