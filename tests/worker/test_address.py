"""Which address a worker binds and advertises (shadow/worker/address.py)."""

from __future__ import annotations

import pytest

from shadow.worker.address import bind_and_advertise, primary_address, route_address


def test_loopback_coordinator_is_served_on_the_same_address():
    assert route_address("tcp://127.0.0.3:5555") == "127.0.0.3"
    assert route_address("tcp://localhost:5555") == "127.0.0.1"
    assert bind_and_advertise("auto", "tcp://127.0.0.4:1") == ("127.0.0.4", "127.0.0.4")


def test_wildcards_bind_everything_but_advertise_a_reachable_address():
    bind, advertised = bind_and_advertise("0.0.0.0", "tcp://0.0.0.0:5555")  # `shadow cluster host=0.0.0.0`
    assert bind == "0.0.0.0" and advertised not in ("0.0.0.0", "") and advertised == primary_address()
    assert bind_and_advertise("*", "tcp://127.0.0.2:1") == ("0.0.0.0", "127.0.0.2")
    assert bind_and_advertise("10.1.2.3", "tcp://127.0.0.1:1") == ("10.1.2.3", "10.1.2.3")


@pytest.mark.parametrize(
    "endpoint,needle",
    [
        ("ipc:///tmp/x", "needs a tcp:// coordinator address"),
        ("tcp://no-such-host.invalid:5555", "cannot resolve the coordinator host"),
    ],
)
def test_auto_needs_a_resolvable_tcp_coordinator(endpoint, needle):
    with pytest.raises(ValueError, match=needle):
        route_address(endpoint)
