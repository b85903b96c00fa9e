"""Write docs/api.md, the Python API and configuration reference, from the code itself:
signatures and docstrings of the public names, every CLI key with its default and help,
every metric, every tuning knob. `tests/repo/test_docs.py` fails when docs/api.md is stale.

    python tools/gen_api_docs.py            # rewrite docs/api.md
    python tools/gen_api_docs.py --check    # exit 1 if it would change
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"


def _doc(obj) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "(undocumented)")


def _sig(name: str, obj) -> str:
    try:
        sig = str(inspect.signature(obj, eval_str=True))
    except (NameError, TypeError, ValueError):
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            sig = "(...)"
    sig = re.sub(r"<class '([\w.]+)'>", r"\1", sig)
    short = {
        "torch.nn.modules.module.Module": "torch.nn.Module",
        "torch.optim.optimizer.Optimizer": "torch.optim.Optimizer",
    }
    sig = re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)\b", lambda m: short.get(m.group(0), m.group(1)), sig)
    return f"{name}{sig}"


def _section_functions(module, names: list[str]) -> list[str]:
    out = []
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            out += [f"### class `{module.__name__}.{name}`", "", _doc(obj), ""]
            if issubclass(obj, BaseException):
                out[-3] = f"### exception `{module.__name__}.{name}`"
                continue
            if dataclasses.is_dataclass(obj):
                hints = typing.get_type_hints(obj)
                out += [
                    f"* `{f.name}`: `{getattr(hints[f.name], '__name__', hints[f.name])}`"
                    for f in dataclasses.fields(obj)
                ]
                out.append("")
            root = module.__name__.split(".")[0]
            members = [
                (n, m)
                for n, m in inspect.getmembers(obj)
                if not n.startswith("_")
                and (inspect.isfunction(m) or isinstance(m, property))
                and (m.fget if isinstance(m, property) else m).__module__.startswith(root)
            ]
            for n, m in members:
                if isinstance(m, property):
                    out += [f"* `{name}.{n}` (property): {_doc(m.fget).splitlines()[0]}"]
                else:
                    out += [
                        f"* `{name}.{_sig(n, m).replace('(self, ', '(').replace('(self)', '()')}`: "
                        + _doc(m).replace("\n\n", "\n").replace("\n", "\n  ")
                    ]
            out.append("")
        else:
            out += [f"### `{module.__name__}.{_sig(name, obj)}`", "", _doc(obj), ""]
    return out


def _knobs() -> list[str]:
    from dataclasses import fields

    from shadow.config.tuning import DEFAULT, Tuning

    out = ["| field | environment variable | default | meaning |", "|---|---|---|---|"]
    out += [
        f"| `{f.name}` | `{f.metadata['env']}` | `{getattr(DEFAULT, f.name)!r}` | {f.metadata['doc']} |"
        for f in fields(Tuning)
    ]
    return out


def render() -> str:
    import shadow.restore
    import trainer_hooks
    from shadow.cli._compose import CONFIGS
    from shadow.cli._help import SUMMARY, keys
    from shadow.core import errors
    from shadow.metrics import catalog

    lines = [
        "# API and configuration reference",
        "",
        "Generated from the code by `python tools/gen_api_docs.py`; do not edit by hand.",
        "",
        "## Trainer side: `trainer_hooks`",
        "",
    ]
    public = [n for n in trainer_hooks.__all__ if not n.endswith("Error")]
    lines += _section_functions(trainer_hooks, public)
    lines += ["## Reading checkpoints: `shadow.restore`", ""]
    lines += _section_functions(shadow.restore, list(shadow.restore.__all__))
    import shadow.planner

    lines += [
        "## Planning: `shadow.planner`",
        "",
        "What `shadow plan` computes, as a library; the model and its assumptions: [planning.md](planning.md).",
        "",
    ]
    lines += _section_functions(
        shadow.planner,
        [
            "plan",
            "analyse",
            "strategies",
            "simulate",
            "simulate_many",
            "size",
            "break_even_overhead",
            "young",
            "daly",
            "Strategy",
        ],
    )
    lines += [
        "## Errors: `shadow.core.errors`",
        "",
        "Every error the service and the hooks raise to callers derives "
        "from `ShadowError` (re-exported by `trainer_hooks`).",
        "",
    ]
    lines += [
        f"* `{n}`: {_doc(getattr(errors, n))}"
        for n in ("ShadowError", "ShadowConnectionError", "ShadowTimeoutError", "LayoutMismatchError")
    ]
    lines += [
        "",
        "## Command line: `shadow COMMAND key=value ...`",
        "",
        "Each command's config is a typed dataclass in `shadow.config`, registered in Hydra's ConfigStore "
        "as `shadow_<command>`; YAML in `configs/` extends it (`--config-dir configs --config-name NAME`). "
        "`--cfg job` prints the resolved config; `--json` (status, ls, verify, jobs, drop, plan) prints JSON.",
        "",
    ]
    for name, cls in CONFIGS.items():
        lines += [
            f"### `shadow {name}`: {SUMMARY[name]}",
            "",
            inspect.cleandoc(cls.__doc__ or "").replace("``", "`"),
            "",
            "| key | default | meaning |",
            "|---|---|---|",
        ]
        lines += [f"| `{k}` | `{d or chr(34) * 2}` | {h.replace('|', '/')} |" for k, d, h in keys(cls)]
        lines.append("")
    lines += [
        "## Metrics",
        "",
        "Coordinator and workers serve them with `metrics_port=`; trainers with "
        "`SHADOW_METRICS_PORT` (port + `LOCAL_RANK`) or `trainer_hooks.serve_metrics(port)`. A counter "
        "`x` is exposed as `x_total`, a summary as `x_sum` and `x_count`.",
        "",
    ]
    for title, group in (
        ("coordinator", catalog.COORDINATOR),
        ("worker", catalog.WORKER),
        ("trainer", catalog.TRAINER),
    ):
        lines += [f"### {title}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        lines += [f"| `{m.name}` | {m.kind} | {', '.join(m.labels) or '-'} | {m.help} |" for m in group]
        lines.append("")
    lines += [
        "## Tuning knobs",
        "",
        "The fields of `shadow.config.tuning.Tuning`: `attach(tuning=)`, `restore(tuning=)`,",
        "a service's `tuning.<field>=`,",
        "else the environment variable, else the default.",
        "",
    ]
    lines += _knobs()
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not what the code says")
    args = ap.parse_args()
    import shadow

    here = Path(shadow.__file__).resolve().parents[1]
    if here != ROOT:  # an editable install of another checkout: its code would be documented here
        print(
            f"shadow is imported from {here}, not from this checkout ({ROOT}); "
            f"run `pip install -e {ROOT}` (or scripts/setup.sh) first",
            file=sys.stderr,
        )
        return 2
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale; run python tools/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
