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
from shadow.config.security import KeygenConfig, SecurityConfig
from shadow.config.services import AgentConfig, ClusterConfig, CoordinatorConfig, TransportConfig, WorkerConfig
from shadow.config.tiers import (
    DEFAULT_TIER_EVERY_S,
    LocalTierConfig,
    PersistConfig,
    RemoteTierConfig,
    TierConfig,
    default_tier_dir,
)

__all__ = [
    "DEFAULT_TIER_EVERY_S",
    "AgentConfig",
    "ClusterConfig",
    "CoordinatorConfig",
    "DropConfig",
    "ExportConfig",
    "JobsConfig",
    "KeygenConfig",
    "ListConfig",
    "LocalTierConfig",
    "PersistConfig",
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
]
