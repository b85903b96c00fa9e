"""Durable by default (issue 52, item 4): a cluster started with no persistence settings
keeps a local tier in this user's data directory, on a time schedule, with retention; one
key (``persist.durable=false``) keeps it in memory only."""

from __future__ import annotations

import pytest

from shadow.config import DEFAULT_TIER_EVERY_S, LocalTierConfig, PersistConfig, default_tier_dir


def test_no_tier_configured_gets_the_default_local_tier(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    cfg = PersistConfig()
    where = cfg.with_default_tier(5555)
    assert where == str(tmp_path / "data" / "shadow" / "cluster-5555") == cfg.local.dir == default_tier_dir(5555)
    assert cfg.local.enabled and cfg.local.every_s == DEFAULT_TIER_EVERY_S == 60.0 and cfg.local.every_n == 0
    assert cfg.local.keep == 3  # retention
    assert default_tier_dir(5556) != where  # two clusters of one user never share a tree


def test_the_data_directory_defaults_to_the_home_share(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_tier_dir(7000) == str(tmp_path / ".local" / "share" / "shadow" / "cluster-7000")


def test_one_key_turns_it_off_and_a_configured_tier_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    off = PersistConfig(durable=False)
    assert off.with_default_tier(5555) == "" and not off.local.enabled
    mine = PersistConfig(LocalTierConfig(dir="/nvme/ckpt", every_n=7))
    assert mine.with_default_tier(5555) == "" and mine.local.dir == "/nvme/ckpt" and mine.local.every_n == 7
    scheduled = PersistConfig(LocalTierConfig(every_n=0, every_s=5.0, keep=2))  # a schedule, no directory
    assert scheduled.with_default_tier(5555) and scheduled.local.every_s == 5.0 and scheduled.local.keep == 2
    with pytest.raises(ValueError, match="persist.durable"):
        PersistConfig(durable="no")  # type: ignore[arg-type]
    assert PersistConfig.from_dict(PersistConfig(durable=False).to_dict()).durable is False
