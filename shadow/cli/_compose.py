"""From a command line to a typed config: Hydra composes the command's schema (and a YAML
config from ``--config-dir``/``--config-name`` when given) with ``key=value`` overrides;
the dataclass validates itself. Errors name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, cast

from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from shadow.config import (
    AgentConfig,
    ClusterConfig,
    CoordinatorConfig,
    DropConfig,
    ExportConfig,
    JobsConfig,
    KeygenConfig,
    ListConfig,
    RestoreConfig,
    StatusConfig,
    VerifyConfig,
    WorkerConfig,
)
from shadow.config.choices import Choice
from shadow.planner.config import PlanConfig

#: every command's config schema, by the command's name
CONFIGS: dict[str, type] = {
    "cluster": ClusterConfig,
    "coordinator": CoordinatorConfig,
    "worker": WorkerConfig,
    "agent": AgentConfig,
    "status": StatusConfig,
    "restore": RestoreConfig,
    "export": ExportConfig,
    "ls": ListConfig,
    "verify": VerifyConfig,
    "jobs": JobsConfig,
    "drop": DropConfig,
    "keygen": KeygenConfig,
    "plan": PlanConfig,
}


def register() -> None:
    """Register every command's schema in Hydra's ConfigStore as ``shadow_<command>``, the
    name a YAML config in ``configs/`` extends (``defaults: [shadow_cluster, _self_]``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, cls in CONFIGS.items():
        cs.store(name=f"shadow_{name}", node=cls)


class UsageError(ValueError):
    pass


@dataclass
class Args:
    """What a command line asked for, before composing."""

    overrides: list[str] = field(default_factory=list)
    config_dir: str | None = None
    config_name: str | None = None
    show: str | None = None  #: --cfg job: print the resolved config and exit
    help: bool = False


_FLAGS_WITH_VALUE = {
    "--config-dir": "config_dir",
    "-cd": "config_dir",
    "--config-name": "config_name",
    "-cn": "config_name",
    "--cfg": "show",
    "-c": "show",
}


def split(argv: list[str]) -> Args:
    """Separate Hydra-style flags from ``key=value`` overrides (``--json`` is ``json=true``)."""
    args, i = Args(), 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a in ("-h", "--help"):
            args.help = True
        elif a == "--json":
            args.overrides.append("json=true")
        elif name in _FLAGS_WITH_VALUE:
            if not eq:
                i += 1
                if i == len(argv):
                    raise UsageError(f"{a} needs a value")
                value = argv[i]
            setattr(args, _FLAGS_WITH_VALUE[name], value)
        elif a.startswith("-"):
            raise UsageError(
                f"unknown flag {a!r}; flags: --help, --json, --cfg job, --config-dir DIR, "
                "--config-name NAME; everything else is key=value"
            )
        elif not eq:
            raise UsageError(f"argument {a!r} is not key=value (e.g. workers=4)")
        else:
            args.overrides.append(a)
        i += 1
    if args.show is not None and args.show not in ("job", "all"):
        raise UsageError(f"--cfg {args.show!r}: only --cfg job (the resolved config) is supported")
    if args.config_dir is not None and args.config_name is None:
        raise UsageError(f"--config-dir {args.config_dir} needs --config-name NAME (a YAML file in it, without .yaml)")
    return args


def compose(command: str, args: Args) -> Any:
    """The typed config of ``shadow command`` for ``args``."""
    register()
    return compose_typed(CONFIGS[command], f"shadow_{command}", args, f"`shadow {command}`")


def compose_typed(cls: type, schema: str, args: Args, who: str) -> Any:
    """An instance of ``cls`` (stored in the ConfigStore as ``schema``) composed from
    ``args``: the schema, or ``--config-dir/--config-name`` YAML extending it, then the
    overrides; validated by the dataclass."""
    from hydra import compose as hydra_compose
    from hydra import initialize, initialize_config_dir
    from hydra.errors import HydraException

    overrides = [_map_override(cls, _choice_override(cls, o)) for o in args.overrides]  # before Hydra starts
    ctx: initialize_config_dir | initialize
    if args.config_name is not None:
        cdir = os.path.abspath(args.config_dir or "configs")
        if not os.path.isdir(cdir):
            raise UsageError(
                f"config directory {cdir} does not exist; pass --config-dir DIR (e.g. the repository's configs/)"
            )
        ctx, name = initialize_config_dir(version_base="1.3", config_dir=cdir), args.config_name
    else:
        ctx, name = initialize(version_base="1.3", config_path=None), schema
    try:
        with ctx:
            cfg = hydra_compose(config_name=name, overrides=overrides)
    except HydraException as exc:
        raise UsageError(_explain(cls, exc)) from None
    except OmegaConfBaseException as exc:
        raise UsageError(_explain(cls, exc)) from None
    if OmegaConf.get_type(cfg) is not cls:
        raise UsageError(
            f"config {args.config_name!r} is a {getattr(OmegaConf.get_type(cfg), '__name__', 'dict')}, "
            f"but {who} needs a {cls.__name__}: its defaults list must start with {schema}"
        )
    _no_unknown_keys(cls, cast(dict, OmegaConf.to_container(cfg, resolve=False)), "")  # a config is a map
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        raise UsageError(f"{getattr(exc, 'full_key', '?')} is required; set it with key=value") from None
    except OmegaConfBaseException as exc:
        raise UsageError(_explain(cls, exc)) from None
    except ValueError as exc:  # the dataclass's own validation
        raise UsageError(str(exc)) from None
    return obj


def parse(cls: type, overrides: list[str]) -> Any:
    """``cls`` from its defaults and ``key=value`` overrides (no YAML)."""
    command = next(k for k, v in CONFIGS.items() if v is cls)
    return compose(command, split(overrides))


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _hint(cls: type, f: dataclasses.Field) -> Any:
    """The type of field ``f`` of ``cls``: its annotation, or, for a section annotated
    ``Any`` (``tuning``, a generated dataclass), the dataclass its default is made from."""
    factory = f.default_factory
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return typing.get_type_hints(cls)[f.name]


def _no_unknown_keys(cls: type, data: dict, prefix: str) -> None:
    """``+key=value`` adds keys Hydra accepts and the dataclass would silently drop."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            raise UsageError(f"unknown key {prefix + key!r}; {_keys_of(cls, prefix)}")
        sub = _hint(cls, fields[key])
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and isinstance(value, dict):
            _no_unknown_keys(sub, value, f"{prefix}{key}.")


def _keys_of(cls: type, prefix: str) -> str:
    return f"keys{' of ' + prefix.rstrip('.') if prefix else ''}: " + ", ".join(
        prefix + f.name for f in dataclasses.fields(cls)
    )


def _field_at(cls: type, dotted: str) -> tuple[type | None, Any, type | None]:
    """(annotation, default, owning dataclass) of a dotted key, or Nones."""
    owner = cls
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if part not in fields:
            return None, None, owner
        f = fields[part]
        hint = _hint(owner, f)
        if i == len(parts) - 1:
            default = f.default if f.default is not dataclasses.MISSING else None
            return hint, default, owner
        owner = hint
    return None, None, None


def _choice_of(hint: Any) -> type[Choice] | None:
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    return base if isinstance(base, type) and issubclass(base, Choice) else None


def _map_override(cls: type, override: str) -> str:
    """``key=value`` for a key inside a field typed as a map (``persist.remote.options.X``),
    as Hydra's add-or-replace (``++key=value``): such a map has no keys of its own to override."""
    key, eq, _ = override.partition("=")
    if not eq or not key or not key[0].isalpha():
        return override
    owner: Any = cls
    for part in key.split(".")[:-1]:
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if part not in fields:
            return override
        owner = _hint(owner, fields[part])
        if typing.get_origin(owner) is dict or owner is dict:
            return "++" + override
    return override


def _choice_override(cls: type, override: str) -> str:
    """``key=value`` for a key that takes a :class:`~shadow.config.choices.Choice`, with the value
    spelled as the member's name (``log_level=info`` -> ``log_level=INFO``); a value that
    is none of the choices is an error naming them. Other overrides pass unchanged."""
    key, eq, value = override.partition("=")
    if not eq or not key or not key[0].isalpha():  # +key=..., ~key: Hydra's own grammar
        return override
    choice = _choice_of(_field_at(cls, key)[0])
    if choice is None or value in ("null", ""):
        return override
    try:
        return f"{key}={choice.parse(value, key).name}"
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _explain(cls: type, exc: Exception) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    key = getattr(cause, "full_key", None)
    first = str(exc).splitlines()[0]
    if not key:
        detail = str(cause).splitlines()[0]
        return first if detail == first else f"{first}: {detail}"
    hint, default, owner = _field_at(cls, key)
    if hint is None:
        prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
        known = _keys_of(owner, prefix) if dataclasses.is_dataclass(owner) else ""
        return f"unknown key {key!r}; {known}" if known else f"{key}: {str(cause).splitlines()[0]}"
    value = getattr(cause, "value", None)
    if value is None:
        value = str(cause).split("'")[1] if "'" in str(cause) else "?"
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if dataclasses.is_dataclass(base):
        return (
            f"{key}={value!r} is not allowed: {key} is a section; set its keys, e.g. {key}.KEY=VALUE "
            f"({_keys_of(base, key + '.')})"
        )
    if isinstance(base, type) and issubclass(base, Choice):
        extra = f" ({base.hint()})" if base.hint() else ""
        return f"{key}={value!r} is not one of {base.values()}{extra}"
    want = _TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))
    return f"{key}={value!r} is not allowed: {key} takes {want} (default {default!r})"
