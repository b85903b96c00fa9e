"""Hosts apart on one machine: network namespaces on a bridge, for network fault tests.

:class:`Network` makes each named host a network namespace with an address of its own on
a bridge; this process's namespace is one more host (``Network.HERE``, the bridge's own
address), where trainers run. Between hosts it can

* :meth:`~Network.cut` and :meth:`~Network.heal` the link between two hosts: each side's
  neighbour entry for the other is pointed at an address no host has, so packets between
  them are dropped silently both ways (as a partition drops them: a connect hangs, a
  stream stalls and retransmits; nothing is refused), while both keep every other link;
  :meth:`~Network.drop` does it one way only (an asymmetric partition: ``a`` no longer
  reaches ``b``, while ``b``'s packets still reach ``a``), :meth:`~Network.undrop` undoes it;
* :meth:`~Network.isolate` a host and :meth:`~Network.rejoin` it: its link to the bridge
  goes down, so it hears no one and no one hears it;
* :meth:`~Network.cap` a host's bandwidth both ways with a ``tbf`` qdisc on each end of its
  link (:meth:`~Network.uncap`);
* run a command on a host (:meth:`~Network.command`, :meth:`~Network.popen`).

:class:`HostCluster` starts a keyed shadow cluster on such hosts: the coordinator on one,
each worker on one of its own with its own key and its own disk, keys laid out as the
deployment recipes lay them out (docs/operations.md, Security): the coordinator and the
workers bind with the server pair and admit each role's allow directory.

Needs root (CAP_NET_ADMIN) and ``ip``/``tc`` from iproute2: :func:`unavailable` says why not
where they are missing, for a clean skip. Everything made is removed on :meth:`Network.close`
(and on leaving a ``with`` block), including after a failed start."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from shadow import security
from shadow.testing.cluster import status
from shadow.testing.wait import wait_until

logger = logging.getLogger(__name__)

#: a link-layer address no host has: neighbour entries pointed here drop a peer's packets
_NOWHERE = "02:00:00:00:de:ad"


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"shp{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Network:
    """Hosts ``hosts`` as network namespaces on a bridge in subnet ``subnet`` (three
    octets; default: a free one of 10.250.x), host i at ``.i+1``; this process's namespace
    is the host :attr:`HERE` at ``.254``. Use as a context manager, or call :meth:`close`."""

    HERE = "here"

    def __init__(self, hosts: Iterable[str], subnet: str | None = None) -> None:
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot make network namespaces: {why}")
        self.hosts = list(hosts)
        if self.HERE in self.hosts or len(set(self.hosts)) != len(self.hosts) or len(self.hosts) > 250:
            raise ValueError(f"hosts must be distinct, at most 250, and not {self.HERE!r}: {self.hosts}")
        self.tag = secrets.token_hex(2)  # names of this network's namespaces and links
        self.subnet = subnet or self._free_subnet()
        self.bridge = f"shb{self.tag}"
        self._ns = {h: f"sh{self.tag}n{i}" for i, h in enumerate(self.hosts)}
        self._addr = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(self.hosts)}
        self._addr[self.HERE] = f"{self.subnet}.254"
        self._cuts: set[frozenset[str]] = set()
        self._drops: set[tuple[str, str]] = set()
        self._isolated: set[str] = set()
        self._capped: set[str] = set()
        self._made: list[Sequence[str]] = []  # undo commands, in reverse order
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- the network ---------------------------------------------------------------------
    @staticmethod
    def _free_subnet() -> str:
        routes = _run(["ip", "-4", "route", "show"]).stdout
        for third in range(200, 256):
            subnet = f"10.250.{third}"
            if f"{subnet}." not in routes:
                return subnet
        raise RuntimeError("no free 10.250.x.0/24 subnet for the test network")

    def _build(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made.append(["ip", "link", "del", self.bridge])
        _run(["ip", "addr", "add", f"{self._addr[self.HERE]}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            ns, outer, inner = self._ns[h], self._outer(h), self._inner(h)
            _run(["ip", "netns", "add", ns])
            self._made.append(["ip", "netns", "del", ns])
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            self._made.append(["ip", "link", "del", outer])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", self.bridge])
            _run(["ip", "link", "set", outer, "up"])
            self._in(h, "ip", "addr", "add", f"{self._addr[h]}/24", "dev", inner)
            self._in(h, "ip", "link", "set", inner, "up")
            self._in(h, "ip", "link", "set", "lo", "up")

    def _outer(self, host: str) -> str:
        return f"sh{self.tag}o{self.hosts.index(host)}"  # this namespace's end, on the bridge

    def _inner(self, host: str) -> str:
        return f"sh{self.tag}i{self.hosts.index(host)}"  # the host's end

    def _device(self, host: str) -> str:
        return self.bridge if host == self.HERE else self._inner(host)

    def _in(self, host: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.command(host), *cmd], check=check)

    def close(self) -> None:
        """Remove every namespace and link this network made (processes still running in a
        namespace keep it until they exit; their links are gone)."""
        while self._made:
            _run(self._made.pop(), check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hosts ---------------------------------------------------------------------------
    def address(self, host: str) -> str:
        """The IPv4 address of ``host``."""
        try:
            return self._addr[host]
        except KeyError:
            raise ValueError(f"no host {host!r} in this network ({[*self.hosts, self.HERE]})") from None

    def command(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host`` (empty for :attr:`HERE`)."""
        if host == self.HERE:
            return []
        self.address(host)
        return ["ip", "netns", "exec", self._ns[host]]

    def popen(self, host: str, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (``kw`` as for :class:`subprocess.Popen`)."""
        return subprocess.Popen([*self.command(host), *cmd], **kw)

    # -- faults --------------------------------------------------------------------------
    def _point(self, host: str, peer: str, mac: str | None) -> None:
        """On ``host``, send what is for ``peer`` to ``mac`` (None: back to the real one)."""
        dev, ip = self._device(host), self.address(peer)
        if mac is None:
            self._in(host, "ip", "neigh", "del", ip, "dev", dev, check=False)
        else:
            self._in(host, "ip", "neigh", "replace", ip, "lladdr", mac, "nud", "permanent", "dev", dev)

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b``, both ways, silently."""
        if a == b:
            raise ValueError(f"cut needs two hosts, not {a!r} twice")
        self._point(a, b, _NOWHERE)
        self._point(b, a, _NOWHERE)
        self._cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`cut` between ``a`` and ``b`` (the neighbours are resolved again)."""
        self._point(a, b, None)
        self._point(b, a, None)
        self._cuts.discard(frozenset((a, b)))
        for x, y in self._drops & {(a, b), (b, a)}:  # a one-way drop of the pair still holds
            self._point(x, y, _NOWHERE)

    def drop(self, a: str, b: str) -> None:
        """Drop every packet from host ``a`` to host ``b``, silently; ``b``'s packets still
        reach ``a`` (an asymmetric partition: ``a``'s data and acknowledgements are lost, so
        ``b`` hears nothing new from ``a`` while ``a`` keeps receiving what ``b`` sends, until
        ``b``'s unacknowledged bytes fill its window)."""
        if a == b:
            raise ValueError(f"drop needs two hosts, not {a!r} twice")
        self._point(a, b, _NOWHERE)
        self._drops.add((a, b))

    def undrop(self, a: str, b: str) -> None:
        """Undo :meth:`drop` from ``a`` to ``b``."""
        if frozenset((a, b)) not in self._cuts:  # a cut of the pair still holds it
            self._point(a, b, None)
        self._drops.discard((a, b))

    def isolate(self, host: str) -> None:
        """Take ``host``'s link to the bridge down: it hears no one and no one hears it."""
        if host == self.HERE:
            raise ValueError("isolate a namespace host; HERE is the bridge itself")
        _run(["ip", "link", "set", self._outer(host), "down"])
        self._isolated.add(host)

    def rejoin(self, host: str) -> None:
        """Undo :meth:`isolate`."""
        _run(["ip", "link", "set", self._outer(host), "up"])
        self._isolated.discard(host)

    def cap(self, host: str, rate: str = "1gbit", burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit ``host``'s link to ``rate`` each way (``tc`` units: ``1gbit``, ``100mbit``)."""
        if host == self.HERE:
            raise ValueError("cap a namespace host; HERE is the bridge itself")
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        self._in(host, "tc", "qdisc", "replace", "dev", self._inner(host), *tbf)  # what it sends
        _run(["tc", "qdisc", "replace", "dev", self._outer(host), *tbf])  # what it receives
        self._capped.add(host)

    def uncap(self, host: str) -> None:
        """Undo :meth:`cap`."""
        self._in(host, "tc", "qdisc", "del", "dev", self._inner(host), "root", check=False)
        _run(["tc", "qdisc", "del", "dev", self._outer(host), "root"], check=False)
        self._capped.discard(host)

    def heal_all(self) -> None:
        """Undo every cut, isolation and cap still in force."""
        for pair in list(self._cuts):
            self.heal(*sorted(pair))
        for a, b in list(self._drops):
            self.undrop(a, b)
        for h in list(self._isolated):
            self.rejoin(h)
        for h in list(self._capped):
            self.uncap(h)

    @property
    def faults(self) -> dict:
        """What is in force now: ``{"cuts": [[a, b], ...], "drops": [[from, to], ...],
        "isolated": [...], "capped": [...]}``."""
        return {
            "cuts": sorted(sorted(p) for p in self._cuts),
            "drops": sorted([a, b] for a, b in self._drops),
            "isolated": sorted(self._isolated),
            "capped": sorted(self._capped),
        }


class ClusterKeys:
    """Role key pairs under ``root`` as ``shadow keygen role=...`` lays them out: the server
    pair at the top, each role's pairs in ``<role>s/``, one worker key per worker host."""

    ROLES = ("worker", "trainer", "client", "admin")

    def __init__(self, root: Path, workers: int) -> None:
        self.root = Path(root)
        security.generate(self.root, "server")
        for i in range(workers):
            security.generate(self.root / "workers", f"worker{i}")
        for role in ("trainer", "client", "admin"):
            security.generate(self.root / f"{role}s", role)
        for d in (self.root, *(self.root / f"{r}s" for r in self.ROLES)):
            d.chmod(0o700)

    def server(self) -> list[str]:
        """The coordinator's arguments: the server pair and every role's allow directory."""
        return [f"security.server_key={self.root / 'server.key_secret'}"] + [
            f"security.allow_{role}s={self.root / f'{role}s'}" for role in self.ROLES
        ]

    def worker(self, i: int) -> list[str]:
        """Worker ``i``'s arguments: the coordinator's, and its own key to connect with."""
        return [*self.server(), f"security.client_key={self.root / 'workers' / f'worker{i}.key_secret'}"]

    def client(self, role: str) -> security.ClientKeys:
        """What a ``role`` process connects with."""
        return security.client_keys(self.root / "server.key", self.root / f"{role}s" / f"{role}.key_secret")

    def env(self, role: str = "trainer") -> dict[str, str]:
        """The environment a ``role`` process (a trainer) finds its keys in."""
        return {
            security.ENV_SERVER_KEY: str(self.root / "server.key"),
            security.ENV_CLIENT_KEY: str(self.root / f"{role}s" / f"{role}.key_secret"),
        }


class HostCluster:
    """A keyed shadow cluster on ``net``: the coordinator on host ``coordinator``, worker i
    on ``workers[i]`` (with ``local_dir`` its own ``<tmp>/disk-<host>``), every process
    logging to ``<tmp>/<host>.log``. ``args`` go to the coordinator (``replicas=2``,
    ``persist.*``), ``worker_args`` to every worker, ``env`` to both (``SHADOW_*`` knobs).
    Workers are restarted by :meth:`restart_worker` only: a worker that exits stays down,
    as a host would. Use as a context manager, or call :meth:`stop`."""

    PORT = 5555  # each host has a network stack of its own: nothing else holds it

    def __init__(
        self,
        net: Network,
        tmp: Path,
        coordinator: str,
        workers: Sequence[str],
        args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
    ) -> None:
        self.net, self.tmp = net, Path(tmp)
        self.coordinator_host, self.worker_hosts = coordinator, list(workers)
        self.address = f"tcp://{net.address(coordinator)}:{self.PORT}"
        self.keys = ClusterKeys(self.tmp / "keys", len(self.worker_hosts))
        self.args, self.worker_args = list(args), list(worker_args)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHADOW_CURVE_")}
        self.env.update(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        try:
            self._start_coordinator()
            for i in range(len(self.worker_hosts)):
                self.start_worker(i)
            self.wait_ready(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _popen(self, host: str, args: Sequence[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{host}.log", "ab")
        self._logs.append(log)
        return self.net.popen(
            host,
            [sys.executable, "-m", "shadow", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(self.tmp),
        )

    def _start_coordinator(self) -> None:
        args = ["coordinator", f"workers={len(self.worker_hosts)}", f"host={self.net.address(self.coordinator_host)}"]
        args += [f"port={self.PORT}", *self.args, *self.keys.server()]
        self.procs[self.coordinator_host] = self._popen(self.coordinator_host, args)

    def start_worker(self, i: int) -> subprocess.Popen:
        """Start (or start again) worker ``i`` on its host, on its own disk."""
        host = self.worker_hosts[i]
        disk = self.tmp / f"disk-{host}"
        disk.mkdir(exist_ok=True)
        args = ["worker", f"coordinator={self.address}", "threads=1", f"worker_id={i}", f"local_dir={disk}"]
        self.procs[host] = self._popen(host, [*args, *self.worker_args, *self.keys.worker(i)])
        return self.procs[host]

    def restart_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` and start it again."""
        p = self.procs[self.worker_hosts[i]]
        if p.poll() is None:
            p.kill()
            p.wait()
        self.start_worker(i)

    def status(self, timeout: float = 5.0) -> dict:
        """The coordinator's status, asked with the client key. Raises TimeoutError."""
        return status(self.address, timeout=timeout, keys=self.keys.client("client"))

    def wait_ready(self, limit: float = 120.0) -> dict:
        """Wait until every worker is registered and ready; a process that exits fails it."""

        def ready() -> dict:
            for host, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{host} exited with {p.returncode}: {self.log_tail(host)}")
            with contextlib.suppress(TimeoutError):
                st = self.status(timeout=1.0)
                if sum(1 for w in st["workers"] if w["ready"]) == len(self.worker_hosts):
                    return st
            return {}

        return wait_until(ready, limit, "every worker ready", period=0.2, detail=lambda: self.log_tail())

    def pids(self) -> dict[str, int]:
        """The pid of every service process still running, by host."""
        return {h: p.pid for h, p in self.procs.items() if p.poll() is None}

    def log_tail(self, host: str | None = None, chars: int = 3000) -> str:
        hosts = [host] if host else [self.coordinator_host, *self.worker_hosts]
        out = []
        for h in hosts:
            with contextlib.suppress(OSError):
                out.append(f"--- {h}\n{(self.tmp / f'{h}.log').read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL), continuing any that were stopped."""
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> HostCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
