"""Typed configuration for every command, validated at construction: the services' (:mod:`.services`),
the tiers' (:mod:`.tiers`), the client commands' (:mod:`.commands`), the tuning knobs (:mod:`.tuning`),
the enums users type (:mod:`.choices`) and log setup (:mod:`.logs`).

The CLI merges ``key=value`` overrides onto these dataclasses with OmegaConf (the
engine under Hydra), so a wrong type or value is an error that names the key.
"""

from shadow.config.checks import check_shape
from shadow.config.commands import (
    DropConfig,
    ExportConfig,
    JobsConfig,
    ListConfig,
    RestoreConfig,
    StatusConfig,
    VerifyConfig,
)
from shadow.config.services import ClusterConfig, CoordinatorConfig, TransportConfig, WorkerConfig
from shadow.config.tiers import (
    DEFAULT_TIER_EVERY_S,
    LocalTierConfig,
    PersistConfig,
    RemoteTierConfig,
    TierConfig,
    default_tier_dir,
)
from shadow.planner.config import PlanConfig
from shadow.security.config import KeygenConfig, SecurityConfig

__all__ = [
    "CONFIGS",
    "DEFAULT_TIER_EVERY_S",
    "ClusterConfig",
    "CoordinatorConfig",
    "DropConfig",
    "ExportConfig",
    "JobsConfig",
    "KeygenConfig",
    "ListConfig",
    "LocalTierConfig",
    "PersistConfig",
    "PlanConfig",
    "RemoteTierConfig",
    "RestoreConfig",
    "SecurityConfig",
    "StatusConfig",
    "TierConfig",
    "TransportConfig",
    "VerifyConfig",
    "WorkerConfig",
    "check_shape",
    "default_tier_dir",
    "register",
]


CONFIGS: dict[str, type] = {
    "cluster": ClusterConfig,
    "coordinator": CoordinatorConfig,
    "worker": WorkerConfig,
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
