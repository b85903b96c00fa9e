"""A worker's control connection that goes silent is replaced by a fresh one, under the same
routing id (issue 56: after a minute of a flapping link, TCP's retransmission backoff kept a
worker unheard for 49 s after the heal).

The coordinator's end here is a ROUTER with ``ROUTER_HANDOVER``, as the coordinator's. A
relay between the two stands for the link: it can swallow every byte of the connections it
carries (a partition that leaves both ends up) and let new ones through."""

from __future__ import annotations

import socket
import threading
from collections import Counter

import zmq

from shadow.testing.wait import wait_until
from shadow.transport import SocketFactory
from shadow.wire import messages as M
from shadow.worker.outbox import ZmqOutbox, routing_id, silence_options


class Relay:
    """Forwards TCP connections from its own port to ``target``; :meth:`cut` makes every
    connection open so far swallow what it carries, both ways."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.cut_before = 0  # connections numbered below this swallow their bytes
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.cut_before = self.accepted + 1

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            number = self.accepted
            up = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b, number), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, number: int) -> None:
        try:
            while not self.stopping:
                data = src.recv(65536)
                if not data:
                    break
                if number >= self.cut_before:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopping = True
        self.listener.close()


def test_silence_options_follow_the_loss_timeout():
    opts = silence_options(1.5)
    assert opts[zmq.HEARTBEAT_IVL] == 500 and opts[zmq.HEARTBEAT_TIMEOUT] == 2000 == opts[zmq.HEARTBEAT_TTL]
    opts = silence_options(30.0)  # a long loss timeout pings once a second, drops after it
    assert opts[zmq.HEARTBEAT_IVL] == 1000 and opts[zmq.HEARTBEAT_TIMEOUT] == 31000
    assert silence_options(0.05)[zmq.HEARTBEAT_IVL] == 100


def test_routing_ids_are_random_and_never_start_with_zero():
    ids = {routing_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 16 and i[0] != 0 for i in ids)


def test_a_silent_control_connection_is_replaced_under_the_same_routing_id():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(port)
    outbox = ZmqOutbox(SocketFactory(ctx, keys=None), f"tcp://127.0.0.1:{relay.port}", Counter(), lost_s=0.6)
    heard: list[tuple[bytes, dict]] = []

    def read() -> None:
        while router.poll(0):
            ident, body = router.recv_multipart()
            heard.append((ident, M.decode(body)))

    def hear(what: str) -> tuple[bytes, dict]:
        def got() -> bool:
            read()
            return bool(heard)

        wait_until(got, 60.0, f"the coordinator's end to hear {what}", detail=lambda: f"accepted {relay.accepted}")
        return heard.pop()

    try:
        outbox.open()
        outbox.to_coord("starting", pid=1, worker_id=0, seconds=0.0)
        ident, msg = hear("the first message")
        assert msg["t"] == "starting" and relay.accepted == 1

        relay.cut()  # both ends up, every byte of the connection swallowed
        outbox.to_coord("starting", pid=1, worker_id=0, seconds=1.0)
        # the silence is noticed after the loss timeout, and a new connection carries on
        wait_until(lambda: relay.accepted >= 2, 60.0, "the worker's end to open a new connection")
        outbox.to_coord("starting", pid=1, worker_id=0, seconds=2.0)
        seen = []
        while True:
            again, msg = hear("a message on the new connection")
            seen.append(msg["seconds"])
            if msg["seconds"] == 2.0:
                break
        assert again == ident  # the same worker to the coordinator: no rejoin needed
        router.send_multipart([ident, M.encode("registered", worker_id=0, awaiting_copy=False)])
        assert outbox.sock is not None
        assert outbox.sock.poll(10_000) and M.decode(outbox.sock.recv())["t"] == "registered"
    finally:
        outbox.close()
        router.close(linger=0)
        relay.stop()
