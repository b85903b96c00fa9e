"""Operating a cluster: every CLI command against a running cluster with a job (parsing
--json), the Prometheus endpoints of coordinator, workers and a trainer (scraped over
HTTP and checked against the metric catalogue), JSON logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.metrics import COORDINATOR, TRAINER, WORKER
from shadow.testing import LocalCluster, free_port, free_port_run
from shadow.testing.procs import catches, communicate, cpu_meter, sleeping
from shadow.testing.wait import wait_progressing
from tests.conftest import ROOT
from tests.helpers import doors
from tests.helpers.cli import shadow_cli as shadow
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, list]:
    """``{sample name: [(labels, value)]}`` from http://127.0.0.1:port/metrics: a reply that
    takes more than 10 s is asked for again, as long as this process or what it started (the
    cluster) uses CPU time."""

    def get() -> str | None:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        except TimeoutError:
            return None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                return None
            raise

    text = wait_progressing(get, cpu_meter(own=True), stall=120, what=f"the metrics at port {port}", period=0)
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def declared(metrics) -> set[str]:
    return {n for m in metrics for n in m.exposed()}


@pytest.mark.timeout(1200)  # against a hang: each wait inside follows what it waits for
def test_cli_and_metrics_against_a_running_cluster(world1, tmp_path):
    started = time.time()
    mport = free_port_run(3)  # the coordinator's, then one per worker
    ckpt = tmp_path / "ckpt"
    cluster = LocalCluster(
        tmp_path,
        args=(
            f"metrics_port={mport}",
            f"persist.local.dir={ckpt}",
            "persist.local.every_n=3",
            "persist.local.compress=zstd",
            "log_format=json",
        ),
    )
    tport = free_port()
    trainer_hooks.serve_metrics(tport)
    session = None
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="ops")
        for it in range(1, 7):
            train_step(ddp, opt, sched, it)

        tm = scrape(tport)  # the trainer, while attached
        assert declared(TRAINER) <= set(tm), declared(TRAINER) - set(tm)
        assert value(tm, "shadow_trainer_iteration", rank=0) == 6
        assert value(tm, "shadow_trainer_hook_count", rank=0) == 6
        assert value(tm, "shadow_trainer_hook_sum", rank=0) > 0
        assert value(tm, "shadow_trainer_bytes_sent_total", rank=0) > 0
        assert 0 <= value(tm, "shadow_trainer_staging_ring_occupancy", rank=0) <= 1
        assert session.close() == 6
        # the checkpoint of iteration 6 is written and committed in the background; and every worker's
        # heartbeat has reported its 6 replays (heartbeats lag under load), and no checkpoint is in
        # flight (under load iteration 3's can still be writing when 6's completes)
        st = cluster.wait_progress(
            lambda st: (
                (st["persist"]["local"]["last_complete"] or {}).get("iteration") == 6
                and not st["persist"]["local"]["in_flight"]
                and all(w["replayed"] == 6 for w in st["workers"])
            ),
            "the local checkpoint of iteration 6 and 6 replays reported by every worker",
        )
        complete = time.time()

        # a malformed frame at worker 0, past its door (the rank's credential, as one who saw it in clear)
        push = doors.push(st["workers"][0]["data"], doors.rank_door(session, 0), linger_ms=0)
        push.send(b"not even a header")
        cluster.wait_progress(lambda st: sum(st["workers"][0]["rejected"].values()), "worker 0 refusing the frame")
        push.close()

        cm = scrape(mport)  # the coordinator
        quiet = {"shadow_auth_refused_total", "shadow_refused_messages_total"}  # nothing was refused here
        assert declared(COORDINATOR) - quiet <= set(cm), declared(COORDINATOR) - set(cm)
        assert value(cm, "shadow_resyncs_total", training_job="ops") == 0
        assert sum(v for lab, v in cm["shadow_rejected_frames_total"] if lab["worker"] == "0") == 1
        assert value(cm, "shadow_committed_iteration", training_job="ops") == 6
        assert value(cm, "shadow_lag_iterations", training_job="ops") == 0
        assert value(cm, "shadow_workers", health="ok") == 2 and value(cm, "shadow_workers_expected") == 2
        assert value(cm, "shadow_checkpoint_complete_iteration", tier="local") == 6
        assert value(cm, "shadow_checkpoint_complete_iteration", tier="memory") == 6
        # completed while this test ran, before it saw so (a second for the rounding of either clock)
        assert started - 1 <= value(cm, "shadow_checkpoint_complete_timestamp_seconds", tier="local") <= complete + 1
        assert value(cm, "shadow_persist_checkpoints_total", tier="local") == 2, (
            cm.get("shadow_persist_skipped_total"),
            cm.get("shadow_persist_failures_total"),
            st["persist"],
        )  # 3 and 6
        assert value(cm, "shadow_persist_bytes_total", tier="local") > 0
        assert value(cm, "shadow_persist_duration_seconds", tier="local") > 0
        for w in (0, 1):
            assert value(cm, "shadow_replay_count", worker=w) == 6
            assert value(cm, "shadow_replay_sum", worker=w) > 0
            assert value(cm, "shadow_bytes_received_total", worker=w) > 0
        for w in (0, 1):  # each worker's own endpoint
            wm = scrape(mport + 1 + w)
            quiet = set() if w == 0 else {"shadow_worker_rejected_frames_total"}  # worker 1 refused nothing
            assert declared(WORKER) - quiet <= set(wm), declared(WORKER) - set(wm)
            assert value(wm, "shadow_worker_applied") == 6
            assert value(wm, "shadow_worker_replay_count") == 6
            assert value(wm, "shadow_worker_persist_count", tier="local") == 2
            assert value(wm, "shadow_worker_persist_bytes_total", tier="local") > 0
            assert value(wm, "shadow_worker_stale") == 0
            assert sum(v for _, v in wm.get("shadow_worker_rejected_frames_total", [])) == (1 if w == 0 else 0)

        res = shadow("status", f"address={cluster.address}", "--json")
        assert res.returncode == 0, res.stderr
        st = json.loads(res.stdout)
        assert st["job"]["committed"] == 6 and st["job"]["name"] == "ops"
        for w in st["workers"]:
            assert w["health"] == "ok" and w["replayed"] == 6 and w["replay_s_per_iteration"] > 0
        res = shadow("status", f"address={cluster.address}")
        assert res.returncode == 0, res.stderr
        for text in ("replay ms/it", "MiB/s in", "committed iteration 6", "local tier", "iteration 6"):
            assert text in res.stdout, (text, res.stdout)

        watch = subprocess.Popen(
            # each redraw asks for the status: a loaded coordinator may take more than the default 5 s
            [sys.executable, "-m", "shadow", "status", f"address={cluster.address}", "watch=0.2", "timeout=60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, COLUMNS="220"),
            # started as a background job of a non-interactive shell is (CI's): SIGINT
            # ignored, which Python inherits and then never raises KeyboardInterrupt
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )

        # SIGINT only once the watch is in its loop and has redrawn there: it catches SIGINT (before
        # its handler, SIGINT is ignored, as said above) and has slept, fetched and drawn, and sleeps
        # again (a sleep between redraws); where the kernel does not say where it sleeps, its handler
        states: list[bool] = []

        def redrawn() -> bool:
            if watch.poll() is not None:
                raise AssertionError(f"the watch ended by itself ({watch.returncode}): {watch.communicate()}")
            if not catches(watch.pid, signal.SIGINT):
                return False
            state = sleeping(watch.pid)
            if state is None:
                return True
            if not states or states[-1] != state:
                states.append(state)
            return states[-3:] == [True, False, True]

        meter = cpu_meter(watch.pid, own=True)
        wait_progressing(redrawn, lambda: (len(states), meter()), stall=120, what="the watch redrawing", period=0.02)
        watch.send_signal(signal.SIGINT)
        out, err = communicate(watch, "the watch to end on SIGINT")
        assert watch.returncode == 0, err
        assert "committed iteration 6" in out and "replay ms/it" in out

        res = shadow("ls", f"source={cluster.address}", "--json")
        rows = json.loads(res.stdout)
        assert {(r["tier"], r["iteration"]) for r in rows} >= {("memory", 6), ("local", 6), ("local", 3)}
        assert all(r["raw_bytes"] > r["bytes"] for r in rows if r["tier"] == "local")  # compressed on disk
        assert "zstd" in shadow("ls", f"source={ckpt}").stdout
        res = shadow("verify", f"source={ckpt}", "deep=true", "--json")
        assert res.returncode == 0, res.stderr
        assert [r["ok"] for r in json.loads(res.stdout)] == [True, True]

        out = tmp_path / "model.safetensors"
        res = shadow("export", f"source={cluster.address}", f"out={out}", "dtype=bfloat16")
        assert res.returncode == 0, res.stderr
        weights = load_file(str(out))
        for name, p in model.named_parameters():
            assert weights[name].dtype == torch.bfloat16
            assert torch.equal(weights[name], p.detach().to(torch.bfloat16))
        out = tmp_path / "model.pt"
        res = shadow("export", f"source={ckpt}", f"out={out}", "format=torch", "iteration=3")
        assert res.returncode == 0 and "iteration 3" in res.stdout, res.stderr
        assert set(torch.load(out, weights_only=True)) >= {n for n, _ in model.named_parameters()}

        res = shadow("restore", f"source={cluster.address}", f"out={tmp_path / 'full.pt'}")
        assert res.returncode == 0, res.stderr
        full = torch.load(tmp_path / "full.pt", weights_only=True)
        assert full["iteration"] == 6
        for name, p in model.named_parameters():
            assert torch.equal(full["model"][name], p.detach())
    finally:
        if session is not None and not session.closed:  # a failed assertion leaves no sender thread behind
            session.close(wait=False)
        cluster.stop()
    events = [json.loads(line) for line in cluster.log.read_text().splitlines() if line.startswith("{")]
    assert events and all({"time", "level", "logger", "pid", "role", "message"} <= set(e) for e in events)
    assert {e["role"] for e in events} >= {"cluster", "worker"}
    assert any("checkpoint of ops iteration 6 complete" in e["message"] for e in events)
