"""Where and when checkpoints persist: the tiers' configs (``persist``)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from shadow.config.choices import Compression

DEFAULT_TIER_EVERY_S = 60.0  #: the default local tier's schedule (PersistConfig.durable)


def default_tier_dir(port: int) -> str:
    """Where a cluster on ``port`` keeps its checkpoints when no tier is configured: this
    user's data directory (``$XDG_DATA_HOME``, else ``~/.local/share``), ``shadow/cluster-<port>``;
    one directory per port, so that two clusters of one user never share a tree, and the
    same cluster restarted finds its own."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "shadow", f"cluster-{port}")


@dataclass
class TierConfig:
    """When a persistence tier takes a checkpoint (any due schedule triggers) and how many
    it keeps."""

    every_n: int = 100  #: iterations between checkpoints (0 = not by iterations)
    every_s: float = 0.0  #: seconds between checkpoints (0 = not by time)
    every_tokens: int = 0  #: tokens between checkpoints, as reported by the trainer (0 = not by tokens)
    keep: int = 3  #: complete checkpoints to retain (0 = keep all)
    compress: Compression = Compression.none  #: none or zstd (lossless: float bytes split into planes, then zstd)
    compress_level: int = 1  #: zstd level, 1 (fastest; on float planes also the smallest measured) to 19

    KEY: ClassVar[str] = "persist.TIER"  # where the tier sits in a config, for error messages

    @property
    def location(self) -> str:
        raise NotImplementedError

    def __post_init__(self) -> None:
        k = self.KEY
        for key in ("every_n", "every_s", "every_tokens", "keep"):
            if getattr(self, key) < 0:
                raise ValueError(f"{k}.{key}={getattr(self, key)} must be >= 0")
        self.compress = Compression.parse(self.compress, f"{k}.compress")
        if not 1 <= self.compress_level <= 19:
            raise ValueError(f"{k}.compress_level={self.compress_level} must be 1 (fastest) to 19 (smallest)")
        if self.location and not (self.every_n or self.every_s or self.every_tokens):
            raise ValueError(
                f"{k} at {self.location!r} has no schedule: set {k}.every_n, {k}.every_s or {k}.every_tokens"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.location)


@dataclass
class LocalTierConfig(TierConfig):
    dir: str = ""  #: directory on the workers' local disk (empty = tier off)
    KEY: ClassVar[str] = "persist.local"

    @property
    def location(self) -> str:
        return self.dir


@dataclass
class RemoteTierConfig(TierConfig):
    url: str = ""  #: shared-file-system path or fsspec URL, filled from the local tier (empty = off)
    #: fsspec storage options for the URL's back end (persist.remote.options.endpoint_url=...; s3fs:
    #: key, secret, endpoint_url, client_kwargs, ...). Credentials are better left to the AWS_* environment
    options: dict[str, Any] = field(default_factory=dict)
    every_n: int = 1000
    KEY: ClassVar[str] = "persist.remote"

    @property
    def location(self) -> str:
        return self.url


@dataclass
class PersistConfig:
    """Persistence tiers: ``local`` (a directory the workers write) and ``remote`` (copied
    from the local tier by the workers, any fsspec URL)."""

    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    #: permissions of checkpoint files, an octal string ("0640"); directories get the same
    #: plus search where read is allowed ("0750"). Empty: 0600 files, 0700 directories
    mode: str = ""
    sign: bool = False  #: sign each manifest (HMAC-SHA256) with the key in security.manifest_key
    # a restarted cluster resumes its jobs from this tier (with_default_tier, default_tier_dir)
    durable: bool = True  #: no tier set: a local one in the user's data dir, every 60 s, keep 3; false = memory only

    def __post_init__(self) -> None:
        if not isinstance(self.sign, bool):
            raise ValueError(f"persist.sign={self.sign!r} must be true or false")
        if not isinstance(self.durable, bool):
            raise ValueError(f"persist.durable={self.durable!r} must be true (the default local tier) or false")
        if self.mode:
            try:
                bits = int(self.mode, 8)
            except ValueError:
                bits = -1
            if not 0 <= bits <= 0o777 or bits & 0o600 != 0o600 or bits & 0o117:
                raise ValueError(
                    f"persist.mode={self.mode!r} is not a checkpoint file mode: the owner must read and write, "
                    "its group may read (and write), no one else may do anything, nothing is executable; give an "
                    "octal string such as 0600 (the default: the owner only) or 0640 (and its group)"
                )
        if self.remote.enabled and not self.local.enabled:
            raise ValueError("persist.remote.url needs persist.local.dir: the remote tier is copied from the local one")
        if "://" in self.local.dir and not self.local.dir.startswith("file://"):
            raise ValueError(f"persist.local.dir={self.local.dir!r} must be a local directory")

    def with_default_tier(self, port: int) -> str:
        """Durable by default: with no local tier configured and ``durable`` on, the local
        tier becomes :func:`default_tier_dir` for the cluster at ``port``, on a time
        schedule (every 60 s unless a local schedule was given; keeping ``keep``). Returns
        the directory chosen, or "" when the config is left as it is."""
        if self.local.enabled or not self.durable:
            return ""
        local = self.local
        if (local.every_n, local.every_s, local.every_tokens) == (TierConfig.every_n, 0.0, 0):
            local.every_n, local.every_s = 0, DEFAULT_TIER_EVERY_S  # a time schedule, whatever the step time
        local.dir = default_tier_dir(port)
        return local.dir

    @property
    def file_mode(self) -> int:
        """The permission bits of a checkpoint file."""
        return int(self.mode, 8) if self.mode else 0o600

    @property
    def dir_mode(self) -> int:
        """The permission bits of a checkpoint directory: the file mode, searchable wherever readable."""
        m = self.file_mode
        return m | ((m & 0o444) >> 2)

    def to_dict(self) -> dict:
        """The plain form the coordinator sends its workers (rebuilt there by :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PersistConfig:
        """The config back from :meth:`to_dict` (a missing field takes its default), validated
        again; only the ``local`` and ``remote`` sections are read (a message may carry more)."""
        try:
            return cls(
                LocalTierConfig(**d.get("local", {})),
                RemoteTierConfig(**d.get("remote", {})),
                mode=d.get("mode", ""),
                sign=d.get("sign", False),
                durable=d.get("durable", True),
            )
        except TypeError as exc:  # an unknown field
            raise ValueError(f"persist: {exc}; the tier fields are those of {LocalTierConfig.__name__}") from None
