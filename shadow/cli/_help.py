"""``shadow COMMAND --help``: what the command does, examples, and every key with its
default and meaning (taken from the config dataclass and its ``#:`` comments)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing

from shadow.cli._compose import CONFIGS
from shadow.config.choices import Choice, Format

EXAMPLES = {
    "cluster": [
        "shadow cluster workers=2 port=5555",
        "shadow cluster workers=4 replicas=2 metrics_port=9400 persist.local.dir=/nvme/shadow persist.local.every_n=50",
        "shadow cluster --config-dir configs --config-name cluster workers=8",
    ],
    "coordinator": [
        "shadow coordinator workers=4 host=0.0.0.0 port=5555 metrics_port=9400",
        "shadow coordinator workers=4 persist.local.dir=/nvme/shadow persist.remote.url=s3://bucket/shadow "
        "persist.remote.compress=zstd",
    ],
    "worker": [
        "shadow worker coordinator=tcp://10.0.0.5:5555            (binds the interface that routes there)",
        "shadow worker coordinator=tcp://10.0.0.5:5555 host=10.0.0.7 metrics_port=9401 worker_id=3",
    ],
    "agent": [
        "shadow agent front=tcp://10.0.0.5:5555 memory_gb=200 cores_per_job=8   (jobs bind the route to the front)",
        "shadow agent front=tcp://10.0.0.5:5555 host=0.0.0.0 job_ports=6000-6015 persist.local.dir=/nvme/shadow",
    ],
    "status": [
        "shadow status address=tcp://127.0.0.1:5555",
        "shadow status address=tcp://10.0.0.5:5555 --json | jq .job.committed",
        "shadow status address=tcp://10.0.0.5:5555 watch=2            (redraws every 2 s)",
    ],
    "restore": [
        "shadow restore source=tcp://127.0.0.1:5555 out=ckpt.pt format=torch",
        "shadow restore source=/nvme/shadow out=ckpt_dcp format=dcp iteration=400",
        "shadow restore source=/nvme/shadow out=out/checkpoint-400 format=hf_trainer iteration=400",
    ],
    "export": [
        "shadow export source=tcp://127.0.0.1:5555 out=model.safetensors dtype=bfloat16",
        "shadow export source=s3://bucket/shadow out=model.pt format=torch iteration=1000",
    ],
    "ls": ["shadow ls source=tcp://127.0.0.1:5555", "shadow ls source=/nvme/shadow --json"],
    "verify": ["shadow verify source=/nvme/shadow", "shadow verify source=s3://bucket/shadow iteration=1000 --json"],
    "jobs": [
        "shadow jobs address=tcp://127.0.0.1:5555",
        "shadow jobs address=tcp://10.0.0.5:5555 --json | jq '.jobs[] | select(.held)'",
    ],
    "drop": [
        "shadow drop job=gpt-small address=tcp://127.0.0.1:5555            (its trainers are gone)",
        "shadow drop job=gpt-small address=tcp://10.0.0.5:5555 security.server_public=keys/server.key "
        "security.client_key=keys/admins/admin.key_secret",
        "shadow drop job=gpt-small address=tcp://127.0.0.1:5555 force=true (even while its trainers heartbeat)",
    ],
    "keygen": ["shadow keygen dir=keys name=server", "shadow keygen dir=keys/clients name=trainer0"],
    "plan": [
        "shadow plan gpus=16384 gpu_mtbf_h=50678 params=405e9 iteration_s=6 restart_s=600",
        "shadow plan --config-dir configs --config-name plan_100k_hourly shadow.overhead=0.005 --json",
    ],
}

SUMMARY = {
    "cluster": "coordinator + N workers on this host, foreground",
    "coordinator": "the coordinator alone (workers join by its address)",
    "worker": "one worker joining a coordinator",
    "agent": "a host that runs jobs for a shared cluster's front on another host, foreground",
    "status": "workers, ranges, committed iteration, lag, rates, tiers (--json for scripts)",
    "restore": f"write a whole checkpoint out ({', '.join(Format.values())})",
    "export": "write a checkpoint's model weights (safetensors or torch, optional bf16/fp16)",
    "ls": "list checkpoints in memory and in every tier",
    "verify": "re-read persisted checkpoints and check every checksum",
    "jobs": "the jobs a cluster knows: the held one (status, trainers heard), attaching, in the tiers",
    "drop": "detach a job whose trainers are gone, keeping its checkpoints, so another can attach",
    "keygen": "write a CURVE key pair (name.key, name.key_secret)",
    "plan": "lost GPU-hours/day per checkpointing strategy (analytic + simulated), shadow cluster size",
}

COMMON = """flags: --help, --json (status, ls, verify, jobs, drop, plan),
       --cfg job (print the resolved config and exit),
       --config-dir DIR --config-name NAME (start from DIR/NAME.yaml, e.g. the repository's configs/)
keys are Hydra overrides: key=value, nested with dots (persist.local.dir=/nvme), null for none."""


def usage() -> str:
    lines = ["usage: shadow COMMAND [key=value ...] [--help]", "", "commands:"]
    lines += [f"  {name:<12} {SUMMARY[name]}\n               e.g.  {EXAMPLES[name][0]}" for name in CONFIGS]
    return "\n".join(lines + ["", COMMON, "", "`shadow COMMAND --help` lists the command's keys."])


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """``name -> text`` of the ``#:`` comments beside a dataclass's fields (and its bases')."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for m in re.finditer(r"^\s+(\w+):[^=\n]+=[^\n]*#:\s*(.+)$", source, re.M):
            out[m.group(1)] = m.group(2).strip()
    return out


def keys(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, help)`` for every leaf of ``cls``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):  # a group typed Any (tuning)
            sub = factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out += keys(sub, f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        shown = "null" if default is None else (str(default).lower() if isinstance(default, bool) else str(default))
        text = _comments(cls).get(f.name, "") or f.metadata.get("help", "")
        if isinstance(sub, type) and issubclass(sub, Choice):
            text = with_choices(text, sub)
        out.append((prefix + f.name, shown, text))
    return out


def with_choices(text: str, choice: type[Choice]) -> str:
    """``text`` (a key's help) naming every value ``choice`` accepts: the ones it does not
    name are added, so that the help follows the enum the key is parsed with."""
    missing = [v for v in choice.values() if not re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", text)]
    if not missing:
        return text
    if not text:
        return "one of " + ", ".join(missing)
    return f"{text}; also {', '.join(missing)}"


def command_help(name: str) -> str:
    cls = CONFIGS[name]
    doc = inspect.cleandoc(cls.__doc__ or "").replace("``", "")
    lines = [f"usage: shadow {name} [key=value ...]", "", doc, "", "examples:"]
    lines += [f"  {e}" for e in EXAMPLES[name]]
    lines += ["", "keys (default):"]
    rows = keys(cls)
    width = max(len(f"{k}={d}") for k, d, _ in rows)
    lines += [f"  {f'{k}={d}':<{width}}  {h}".rstrip() for k, d, h in rows]
    return "\n".join(lines + ["", COMMON])
