"""What each side imports. The service (workers, coordinator, the CLI, restore) loads no
torch and no trainer code; ``import trainer_hooks``, and a restore from memory, load
neither numba nor zstandard. On a host without torch the service's commands
run, and the commands that need torch stop before any work, naming the extra to install.

"Without torch" is a ``sitecustomize`` on ``PYTHONPATH`` that makes ``import torch`` (and
``safetensors``) fail, in every process started with it, workers included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.cli import shadow_cli

NO_TORCH = '''
import sys


class _NoTorch:
    """A host where torch (and safetensors, which needs it) is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "safetensors"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def _run(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )


def _loaded_by(module: str, watch: tuple[str, ...], env: dict | None = None) -> list[str]:
    """Which of ``watch`` are in ``sys.modules`` after a fresh interpreter imports ``module``."""
    res = _run(
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        f"print(json.dumps([m for m in {list(watch)!r} if m in sys.modules]))",
        env,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def no_torch(tmp_path) -> dict:
    """The environment of a host without torch (a service-only install)."""
    site = tmp_path / "no_torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    path = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


# ---- the service loads no torch ------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    ["shadow.worker.server", "shadow.coordinator.server", "shadow.cli.main", "shadow.restore", "shadow.export"],
)
def test_the_service_imports_no_torch_and_no_trainer_code(module):
    assert _loaded_by(module, ("torch", "safetensors", "trainer_hooks")) == []


def test_trainer_hooks_loads_no_numba_or_zstandard_at_import():
    assert _loaded_by("trainer_hooks", ("numba", "zstandard", "fsspec", "shadow.kernels", "shadow.persist")) == []


def test_a_restore_from_memory_loads_no_tier_reader():
    """What ``trainer_hooks.restore(source=tcp://...)`` imports to read a cluster's memory
    leaves the tiers' readers and codecs (numba, zstandard, fsspec) unloaded; naming a tier
    source loads them."""
    memory_path = "shadow.restore.resolve, shadow.restore.MemorySource, shadow.restore.fetch_memory"
    watch = ("numba", "zstandard", "fsspec", "shadow.persist", "shadow.kernels")
    res = _run(
        f"import json, sys, shadow.restore, shadow.restore.resolve; {memory_path}; "
        f"print(json.dumps([m for m in {list(watch)!r} if m in sys.modules]))"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    res = _run("import sys, shadow.restore; shadow.restore.open_source('/tmp'); print('fsspec' in sys.modules)")
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr


def test_trainer_hooks_reexports_the_exporters():
    import trainer_hooks
    from shadow import export
    from shadow.export import state

    assert trainer_hooks.export is export.export and trainer_hooks.export_weights is export.export_weights
    assert trainer_hooks.state_dicts is state.state_dicts


# ---- a host without torch ------------------------------------------------------------------


def test_the_blocker_stands_in_for_a_host_without_torch(no_torch):
    res = _run("import torch", no_torch)
    assert res.returncode == 1 and "No module named 'torch'" in res.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        ("restore", "format=torch"),
        ("restore", "format=dcp"),
        ("restore", "format=safetensors"),
        ("export", "format=safetensors"),
        ("export", "format=torch"),
    ],
)
def test_writing_a_file_without_torch_names_the_extra(no_torch, tmp_path, cmd):
    name, fmt = cmd
    # nothing listens on the source: the error must come before any attempt to read it
    res = shadow_cli(
        name, "source=tcp://127.0.0.1:9", f"out={tmp_path / 'out'}", fmt, "timeout=30", env=no_torch, timeout=60
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "shadow-checkpoint[trainer]" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"shadow {name}: writing ") and "needs PyTorch" in res.stderr
    assert not (tmp_path / "out").exists()


def test_the_exporters_without_torch_raise_a_shadow_error(no_torch, tmp_path):
    out = tmp_path / "w.st"
    res = _run(
        "from shadow.core.errors import ShadowError\n"
        "from shadow.export import TorchMissingError, export_weights\n"
        f"try:\n    export_weights(None, {str(out)!r})\n"
        "except TorchMissingError as exc:\n"
        "    assert isinstance(exc, ShadowError) and isinstance(exc, ImportError)\n"
        "    print(exc)\n",
        no_torch,
    )
    assert res.returncode == 0, res.stderr
    assert "pip install 'shadow-checkpoint[trainer]'" in res.stdout


def test_ls_and_verify_run_without_torch(no_torch, tmp_path):
    from tests.persist.test_persist_units import LAYOUT, _write_checkpoint

    root = str(tmp_path / "ckpt")
    _write_checkpoint(root, "j", 3, LAYOUT)
    res = shadow_cli("ls", f"source={root}", "--json", env=no_torch, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [(r["job"], r["iteration"], r["state"]) for r in rows] == [("j", 3, "complete")]
    res = shadow_cli("verify", f"source={root}", "deep=true", env=no_torch, timeout=60)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_a_cluster_runs_and_answers_status_without_torch(no_torch, tmp_path):
    from shadow.testing import LocalCluster

    with LocalCluster(Path(tmp_path), workers=1, env=no_torch, start_timeout=120) as c:
        res = shadow_cli("status", f"address={c.address}", "--json", env=no_torch, timeout=60)
        assert res.returncode == 0, res.stderr
        st = json.loads(res.stdout)
        assert [w["ready"] for w in st["workers"]] == [True]
        res = shadow_cli("ls", f"source={c.address}", "--json", env=no_torch, timeout=60)
        assert res.returncode == 0 and json.loads(res.stdout) == [], res.stderr


# each integration imports its own framework and no other integration's (hf may use accelerate's,
# which its extra installs); what they share is in integrations/_resume.py, which imports none
_FRAMEWORKS = {"accelerate": set(), "hf": {"accelerate"}, "lightning": set()}


@pytest.mark.parametrize("name", sorted(_FRAMEWORKS))
def test_an_integration_imports_no_other_integration(name):
    import ast
    from pathlib import Path

    import trainer_hooks.integrations as pkg

    src = Path(pkg.__file__).with_name(f"{name}.py").read_text()
    imported = {
        n.module.split(".")[2]
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("trainer_hooks.integrations.")
    }
    assert imported - {"_resume"} <= _FRAMEWORKS[name], imported


# ---- old import paths ------------------------------------------------------------------------


def test_a_module_that_moved_into_a_package_imports_by_its_old_path_as_the_same_module():
    import importlib

    import shadow

    for old, new in shadow.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from shadow.errors import CheckpointError  # as users and docs write them
    from shadow.tuning import Tuning

    assert Tuning.__module__ == "shadow.config.tuning" and CheckpointError.__module__ == "shadow.core.errors"
    for old in shadow.MOVED:  # nothing is left at an old path beside its alias
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
