"""How shadow's bytes move.

* :mod:`shadow.transport.sockets`: the one place a ZeroMQ socket gets its options (linger,
  high-water marks, the largest message a peer may send, CURVE on either side);
* :mod:`shadow.transport.send`: :class:`DataSender`, a trainer's ordered channel per worker;
* :mod:`shadow.transport.receive`: :class:`FrameReceiver`, a worker's reads and checks of
  one data message;
* :mod:`shadow.transport.fetch`: the one reader of a shard's fetch reply (restore, peer copy).
"""

from shadow.transport.receive import Context, FrameReceiver
from shadow.transport.send import DataSender, ZmqDataSender
from shadow.transport.sockets import SocketFactory, data_limit, fetch_limit

__all__ = ["Context", "DataSender", "FrameReceiver", "SocketFactory", "ZmqDataSender", "data_limit", "fetch_limit"]
