"""The sending end keeps a zero-copy message's buffers until ZeroMQ no longer reads any of
them. pyzmq's ``send_multipart(track=True)`` returns the last frame's tracker only, and a
frame under the copy threshold (64 KiB) is copied with a tracker done at once: a bucket
whose last run is short came back done while its large runs still waited in the queue, the
sender released the staging slot, the next bucket overwrote it, and the worker refused the
bytes as failing their MAC (a stale worker and a resync, seen every few dozen iterations of
a 25M GPT)."""

from __future__ import annotations

import time

import numpy as np
import zmq

from shadow.transport.send import ZmqDataSender


def test_a_message_is_tracked_until_its_large_frames_are_sent_whatever_its_last_frame():
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 4096)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender = ZmqDataSender(ctx, [f"tcp://127.0.0.1:{port}"], hwm=1000, curve=[False])
    try:
        big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB: far more than the socket buffers hold
        trackers = [sender.send(0, [b"head", big.data, b"short tail"], track=True) for _ in range(3)]
        time.sleep(0.3)  # nothing is read: the large frames cannot all have left
        assert trackers[-1] is not None and not trackers[-1].done
        got = []
        for _ in range(3):
            assert pull.poll(10_000)
            got.append(pull.recv_multipart())
        assert all(len(m) == 3 and m[1] == big.tobytes() and m[2] == b"short tail" for m in got)
        deadline = time.monotonic() + 30
        while not all(t.done for t in trackers) and time.monotonic() < deadline:  # freed once sent
            time.sleep(0.01)
        assert all(t.done for t in trackers)
        assert sender.send(0, [b"head", b"copied"], track=False) is None
    finally:
        sender.close()
        pull.close(linger=0)
