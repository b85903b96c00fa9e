"""Serving a worker's shard to restore clients (``fetch`` on the serve socket): answered
once the wanted iteration is applied, from the current epoch or, while a re-attach
bootstraps, the retired one. Imports no torch."""
from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from shadow import knobs
from shadow.wire import frames as F
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


class ServeMixin:
    """Worker handlers for the serve socket."""
    def _on_serve(self, sock) -> None:
        parts = sock.recv_multipart(zmq.NOBLOCK)
        if len(parts) != 2:
            self.rejected["serve_malformed"] += 1
            return
        ident, raw = parts
        try:
            msg = M.decode(raw)
            if msg["t"] != "fetch":
                raise M.MessageError("unexpected", f"serve socket got {msg['t']!r}")
        except M.MessageError as exc:
            self.rejected["serve_" + exc.reason] += 1
            sock.send_multipart([ident, M.encode("error", message=str(exc))])
            return
        self.pending_fetch.append((ident, msg, time.monotonic() + knobs.get("FETCH_TIMEOUT_S")))
        self._answer_fetches()

    def _answer_fetches(self) -> None:
        keep = []
        for ident, msg, deadline in self.pending_fetch:
            want = msg["iteration"]
            s = self.retired if self.retired is not None and msg["epoch"] == self.retired.epoch else self.session
            if s is None or msg["epoch"] != s.epoch:
                self._serve_error(ident, f"worker serves epoch {s.epoch if s else None}, not {msg['epoch']}")
            elif s.applied == want or (want < 0 and s.applied >= 0):
                self._serve_state(ident, s)
            elif s.applied > want:
                self._serve_error(ident, f"worker has moved on to iteration {s.applied}; fetch {want} again later")
            else:
                keep.append((ident, msg, deadline))
        self.pending_fetch = keep

    def _expire_fetches(self, now: float) -> None:
        keep = []
        for ident, msg, deadline in self.pending_fetch:
            if now > deadline:
                self._serve_error(ident, f"iteration {msg['iteration']} was not applied here in time")
            else:
                keep.append((ident, msg, deadline))
        self.pending_fetch = keep

    def _serve_error(self, ident: bytes, text: str) -> None:
        self.serve.send_multipart([ident, M.encode("error", message=text)])

    def _serve_state(self, ident: bytes, s) -> None:
        """Send session ``s``'s shard: a head (with each chunk's xxh3), then each field in
        chunks of at most ``FETCH_CHUNK_BYTES``, zero-copy from the live arrays. The next
        apply waits (``SERVE_HOLD_S`` at most, :meth:`_wait_for_readers`) until zmq has
        sent them; a client still reading after that gets chunks that fail their sums and
        fetches again, so it never installs a torn shard."""
        st = s.state
        fields = st.fields()
        idx = np.flatnonzero(st.in_range)
        chunk = knobs.get_int("FETCH_CHUNK_BYTES") // 4 * 4
        views = []
        for f in fields:
            raw = st.array(f).view(np.uint8)
            views += [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
        extras = sorted(s.extras.items())  # chunks of the model state outside the optimizer, after the arrays
        head = M.encode(
            "fetch_reply", epoch=s.epoch, iteration=s.applied, start=st.start, stop=st.stop,
            arrays=[int(f) for f in fields], steps=[[int(i), float(st.steps[i])] for i in idx],
            has_state=[int(i) for i in idx if st.has_state[i]],
            commits=[[int(r), b] for r, b in sorted(s.blobs.items())],
            replay=s.commit, chunk=chunk, sums=[F.checksum(v) for v in views],
            extras=[[k, len(b), F.checksum(b)] for k, b in extras],
        )
        views += [b for _, b in extras]
        tracker = self.serve.send_multipart([ident, head] + [memoryview(v) for v in views], copy=False, track=True)
        self.serving = [(t, d) for t, d in self.serving if not t.done]
        self.serving.append((tracker, time.monotonic() + knobs.get("SERVE_HOLD_S")))

    def _wait_for_readers(self) -> None:
        """Before the state changes: let zmq finish sending shards served from it."""
        for tracker, deadline in self.serving:
            if tracker.done:
                continue
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                logger.warning("a restore client is still reading this shard after %.1f s; applying anyway "
                               "(its copy will fail its checksums and be fetched again)", knobs.get("SERVE_HOLD_S"))
        self.serving = []
