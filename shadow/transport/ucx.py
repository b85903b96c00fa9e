"""The data path over UCX (``transport.data=ucx``), for RDMA fabrics (InfiniBand, RoCE, EFA)
and, in tests and on hosts without them, TCP. Needs the optional extra
``shadow-checkpoint[ucx]`` (UCX for Python, ``ucxx``); ZeroMQ stays the default data path
and the only control plane.

One UCX connection per trainer rank and worker, opened to the worker's listener
(``ucx://host:port``, advertised in its register like a ZeroMQ endpoint). The worker opens
each connection with :data:`READY`, and the trainer writes nothing to it before (see
:class:`UcxDataSender`). Each connection then carries an ordered stream of data messages,
the same messages as over ZeroMQ (``shadow.wire.frames``: a header frame, then one part per
run, tagged with checksums or, on a keyed cluster's ``mac`` data path, MACs under the
rank's key). On the stream a message is:

* a preamble (:data:`PREAMBLE`: magic, frame count, total bytes) and the frames' sizes,
  8 bytes each, sent together from one small buffer;
* the frames, each sent zero-copy from where the trainer holds it (the pinned staging ring
  for gradients) and received into one fresh buffer per message, where the worker's
  kernels read the parts (the ZeroMQ path keeps its frames the same way).

What reaches a worker is checked before it is believed, as on ZeroMQ:
:class:`UcxDataSocket` refuses a preamble that is not ours, a frame count or size beyond
what a sender ever makes, and a connection that queues more messages than the data path's
receive high-water mark (it closes that connection: UCX streams have no receive-side flow
control, so a connection that outruns the worker is not read into memory without bound;
a trainer's credit keeps a real one far below it). Every frame then goes through
:class:`~shadow.transport.receive.FrameReceiver` (tags or MACs, bounds, epoch, layout).
UCX carries no CURVE: a keyed cluster streams over UCX in ``mac`` mode only.

Delivery is acknowledged: the worker tells each connection how many messages reached it
whole (:data:`ACKED`), and the trainer keeps a message, and its ring slots, until then. A
ready connection that is lost while its worker lives (UCX over TCP closed some under load,
with no fault) is made again and its unacknowledged messages sent again, in order; the
probe names the channel with a token, so the worker reads the lost connection's queue
first, and drops what arrives twice by sequence number. A dead worker refuses the new
connections (UCX's peer error handling is on): after a few, the channel is broken, its
messages given up and later ones dropped until it is opened again
(:meth:`UcxDataSender.open`: a resync's new sender, or a ``replica_in``); the coordinator
finds the messages missing and resyncs, as when a ZeroMQ connection drops. A worker that
comes back listens on a new port, which only the coordinator knows. No UCX callback runs
Python on UCX's progress thread: it would wait for the GIL while holding the UCX worker's
lock, which a send on the sender thread waits for.

Settings: UCX's own environment (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) applies as
documented by UCX; the TCP transport's segment size defaults to 1 MiB here
(:data:`DEFAULTS`; UCX's 64 KiB moves large frames at about a third of ZeroMQ's rate),
unless the environment sets it.

Where it lives: the trainer's end in :mod:`shadow.transport.ucx_send` (its channels' state
in :mod:`shadow.transport.ucx_channel`), the worker's in :mod:`shadow.transport.ucx_socket`,
what both share in :mod:`shadow.transport.ucx_base`; this module names what the rest of
shadow, its tools and its tests use of the UCX data path.
"""

from shadow.transport.ucx_base import (
    ACK,
    ACKED,
    ACKED_MAGIC,
    CONNECT_ATTEMPTS,
    DEFAULTS,
    INSTALL,
    MAGIC,
    MAX_CONNECTIONS,
    PREAMBLE,
    PROBE,
    READY,
    RECONNECTS,
    SCHEME,
    SIZE,
    TOKEN_BYTES,
    available,
    endpoint,
    is_ucx,
    lib,
    parse,
)
from shadow.transport.ucx_send import UcxDataSender
from shadow.transport.ucx_socket import UcxDataSocket

__all__ = [
    "ACK",
    "ACKED",
    "ACKED_MAGIC",
    "CONNECT_ATTEMPTS",
    "DEFAULTS",
    "INSTALL",
    "MAGIC",
    "MAX_CONNECTIONS",
    "PREAMBLE",
    "PROBE",
    "READY",
    "RECONNECTS",
    "SCHEME",
    "SIZE",
    "TOKEN_BYTES",
    "UcxDataSender",
    "UcxDataSocket",
    "available",
    "endpoint",
    "is_ucx",
    "lib",
    "parse",
]
