"""The worker's data plane: validate each frame (header, epoch, layout, sequence, bounds,
checksums), receive payloads straight into their slots, record commits, report PREPARED.
Imports no torch."""

from __future__ import annotations

import logging

import numpy as np
import zmq

from shadow import knobs
from shadow.wire import frames as F
from shadow.worker.commit import decode_commit, same

logger = logging.getLogger(__name__)


class DataMixin:
    """Worker handlers for the data socket."""

    def _discard_rest(self, sock) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()

    def _on_data(self, sock) -> None:
        raw = sock.recv(zmq.NOBLOCK)
        self.frames_in += 1
        try:
            self._take_frame(sock, raw)
        except F.FrameError as exc:
            self.rejected[exc.reason] += 1
            self._discard_rest(sock)
            if exc.reason == "stale":
                logger.debug("dropped frame: %s", exc)
            else:
                logger.warning("rejected frame: %s", exc)
            # a duplicate (sequence already seen) is dropped and counted, and so is a frame whose
            # header does not check out (it consumed no sequence number: if it was a real one,
            # the next frame shows the gap); bytes lost or changed after the sequence check
            # leave this replica unusable until a resync
            if exc.reason in (
                "gap",
                "double_commit",
                "bad_checksum",
                "truncated_payload",
                "extra_payload",
                "overflow",
                "disagree",
            ):
                self._go_stale(str(exc))
        except zmq.ZMQError:
            raise
        except Exception as exc:  # a bug meeting an input: count it, keep going, trust this replica no more
            self.rejected["data_error_" + type(exc).__name__] += 1
            logger.exception("a data frame could not be handled")
            self._discard_rest(sock)
            self._go_stale(f"a data frame could not be handled ({type(exc).__name__}: {exc})")

    def _take_frame(self, sock, raw: bytes) -> None:
        h = F.unpack_header(raw, knobs.get_int("MAX_RUNS"))
        s = self.session
        if s is None:
            raise F.FrameError("not_configured", "frame arrived before this worker was configured")
        if h.epoch != s.epoch or h.job != s.job_id:
            raise F.FrameError(
                "wrong_epoch", f"frame for job {h.job:#x} epoch {h.epoch}, serving {s.job_id:#x} epoch {s.epoch}"
            )
        if h.layout != s.layout_hash:
            raise F.FrameError("wrong_layout", f"layout {h.layout:#x} is not {s.layout_hash:#x}")
        if h.world != s.world:
            raise F.FrameError("bad_rank", f"world {h.world} is not {s.world}")
        if s.stale:
            raise F.FrameError("stale", "worker is stale; frames ignored until resync")
        if h.iteration <= s.applied or h.iteration < s.base:
            raise F.FrameError("old_iteration", f"iteration {h.iteration} is not after applied {s.applied}")
        # the iterations a trainer may send: its slots bound how far ahead of the applied one
        horizon = (s.applied if s.applied >= 0 else s.base - 1) + s.inbox.nslots
        if h.iteration > horizon:
            raise F.FrameError(
                "out_of_window",
                f"iteration {h.iteration} is beyond {horizon} (applied {s.applied}, {s.inbox.nslots} slots)",
            )
        self._check_runs(h)  # before the sequence check: a malformed header consumes no sequence number
        s.inbox.check_seq(h.rank, h.seq, knobs.get_int("SEQ_WINDOW"))
        if h.kind == F.Kind.COMMIT:
            self._take_commit(sock, h)
        elif h.kind == F.Kind.EXTRA:
            self._take_extra(sock, h)
        else:
            self._take_payload(sock, h)
        s.seen = max(s.seen, h.iteration)
        self._report_prepared()

    def _check_runs(self, h: F.Header) -> None:
        """The run table against this session: runs inside the worker's range, no part
        larger than a sender ever makes, one commit body of bounded size."""
        s = self.session
        cap = knobs.get_int("MAX_COMMIT_BYTES")
        if h.kind == F.Kind.COMMIT:
            if len(h.runs) != 1:
                raise F.FrameError("bad_commit", f"commit has {len(h.runs)} runs, expected 1")
            if h.runs[0][1] > cap:
                raise F.FrameError(
                    "bad_commit", f"commit of {h.runs[0][1]} bytes exceeds the limit of {cap} (SHADOW_MAX_COMMIT_BYTES)"
                )
        elif h.kind == F.Kind.EXTRA:
            if h.field != F.Field.GRAD:
                raise F.FrameError("bad_kind", f"EXTRA frame for field {h.field.name}")
            for _, nbytes, _ in h.runs:
                if not 0 < nbytes <= cap:
                    raise F.FrameError("bad_extra", f"a chunk of {nbytes} bytes (limit {cap}, SHADOW_MAX_COMMIT_BYTES)")
        else:
            lo, hi = s.state.start, s.state.stop
            most = F.MAX_PART_BYTES // 4
            for dst, nelem, _ in h.runs:
                if nelem == 0 or dst < lo or dst + nelem > hi:
                    raise F.FrameError("out_of_range", f"run [{dst}, {dst + nelem}) is outside [{lo}, {hi})")
                if nelem > most:
                    raise F.FrameError("too_large", f"a run of {nelem} elements; parts carry at most {most}")
            if h.kind == F.Kind.STATE:
                if h.field == F.Field.GRAD or h.field not in s.state.fields():
                    raise F.FrameError("bad_kind", f"STATE frame for field {h.field.name}")
            elif h.field != F.Field.GRAD:
                raise F.FrameError("bad_kind", f"GRAD frame for field {h.field.name}")

    def _recv_part_into(self, sock, target: np.ndarray, nbytes: int) -> None:
        if not sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", "message has fewer payload frames than runs")
        got = sock.recv_into(target)
        if got != nbytes:
            raise F.FrameError("truncated_payload", f"payload is {got} bytes, run says {nbytes}")
        self.bytes_in += got

    def _recv_part(self, sock, nbytes: int) -> np.ndarray:
        if not sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", "message has fewer payload frames than runs")
        frame = sock.recv(copy=False)
        if len(frame) != nbytes:
            raise F.FrameError("truncated_payload", f"payload is {len(frame)} bytes, run says {nbytes}")
        self.bytes_in += nbytes
        return np.frombuffer(frame.buffer, dtype=np.float32)

    def _take_payload(self, sock, h: F.Header) -> None:
        s = self.session
        lo = s.state.start
        if h.kind == F.Kind.STATE:
            slot = s.inbox.slot(h.iteration, F.Kind.STATE)
            target = s.state.array(h.field)
        else:
            slot = s.inbox.slot(h.iteration, F.Kind.GRAD)
            target = None
        if slot.commits[h.rank] is not None:
            raise F.FrameError("after_commit", f"rank {h.rank} sent data for iteration {h.iteration} after its commit")
        total, parts = 0, []
        for dst, nelem, csum in h.runs:
            if target is None:  # a gradient: keep the frame, the kernel reads it where it lies
                view = self._recv_part(sock, nelem * 4)
                parts.append((dst - lo, view))
            else:
                view = target[dst - lo : dst - lo + nelem]
                self._recv_part_into(sock, view, nelem * 4)
            if F.checksum(view) != csum:
                raise F.FrameError(
                    "bad_checksum", f"payload at flat {dst} (+{nelem}) from rank {h.rank} iteration {h.iteration}"
                )
            total += nelem
        if sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "message has more payload frames than runs")
        slot.received[h.rank] += total
        slot.parts.extend(parts)
        if h.kind == F.Kind.STATE:
            slot.field_elems[int(h.field)] = slot.field_elems.get(int(h.field), 0) + total

    def _take_extra(self, sock, h: F.Header) -> None:
        """Chunks of model state outside the optimizer (``trainer_hooks._extras``), kept
        zero-copy by key; the worker's set takes them when their iteration is applied."""
        s = self.session
        slot = s.inbox.slot(h.iteration, F.Kind.STATE if h.iteration == s.base else F.Kind.GRAD)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("after_commit", f"rank {h.rank} sent data for iteration {h.iteration} after its commit")
        for key, nbytes, csum in h.runs:
            if not sock.getsockopt(zmq.RCVMORE):
                raise F.FrameError("truncated_payload", "message has fewer payload frames than runs")
            frame = sock.recv(copy=False)
            if len(frame) != nbytes:
                raise F.FrameError("truncated_payload", f"payload is {len(frame)} bytes, run says {nbytes}")
            if F.checksum(frame.buffer) != csum:
                raise F.FrameError("bad_checksum", f"extras chunk {key:#x} from rank {h.rank} iteration {h.iteration}")
            self.bytes_in += nbytes
            slot.extras[key] = frame.buffer
        if sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "message has more payload frames than runs")
        slot.extra_count[h.rank] += len(h.runs)

    def _take_commit(self, sock, h: F.Header) -> None:
        s = self.session
        _, nbytes, csum = h.runs[0]
        if not sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", "commit without body")
        body = sock.recv()
        if len(body) != nbytes or F.checksum(body) != csum:
            raise F.FrameError("bad_checksum", f"commit body of rank {h.rank} iteration {h.iteration}")
        if sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "commit has more than one body frame")
        replay, blob = decode_commit(body, h, len(s.layout.params), s.layout.num_groups)
        kind = F.Kind.STATE if replay["bootstrap"] else F.Kind.GRAD
        if replay["bootstrap"] != (h.iteration == s.base):
            raise F.FrameError(
                "bad_commit", f"bootstrap flag {replay['bootstrap']} at iteration {h.iteration} (base {s.base})"
            )
        slot = s.inbox.slot(h.iteration, kind)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("double_commit", f"second commit from rank {h.rank} for iteration {h.iteration}")
        for other in slot.commits:
            if other is not None and any(
                not same(other.get(k), replay.get(k))
                for k in ("groups", "skipped", "clip", "inv_scale", "grad_scale", "skip_step")
            ):
                raise F.FrameError(
                    "disagree", f"rank {h.rank} commits different hyperparameters for iteration {h.iteration}"
                )
        slot.commits[h.rank] = replay
        if blob is not None:
            slot.blobs[h.rank] = blob

    def _report_prepared(self) -> None:
        s = self.session
        k = s.prepared + 1
        while True:
            slot = s.inbox.slots.get(k)
            if slot is None or not s.inbox.complete(slot):
                break
            k += 1
        if k - 1 > s.prepared:
            s.prepared = k - 1
            c = s.inbox.slots[s.prepared].commits[0]
            self._to_coord("prepared", epoch=s.epoch, iteration=s.prepared, tokens=c.get("tokens"))
