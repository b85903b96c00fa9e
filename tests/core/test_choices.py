"""Enums replace the string config fields: a member is its spelling (equal to it, formatted
as it, sent on the wire as it), and a value outside the set is an error naming the choices."""

from __future__ import annotations

import json

import msgpack
import pytest

from shadow.cli._compose import UsageError, parse
from shadow.config import ClusterConfig, ExportConfig, LocalTierConfig, PersistConfig, RestoreConfig
from shadow.config.choices import Choice, Compression, Dtype, Format, LogFormat, LogLevel, Policy, WeightFormat


def test_a_member_is_its_spelling():
    z = Compression.zstd
    assert z == "zstd" and f"{z}" == "zstd" and str(z) == "zstd" and f"{z:>6}" == "  zstd"
    assert msgpack.unpackb(msgpack.packb({"c": z})) == {"c": "zstd"} and json.dumps(z) == '"zstd"'
    for cls in (Compression, LogLevel, LogFormat, Format, WeightFormat, Dtype, Policy):
        assert all(m.name == m.value for m in cls), cls  # the name is what OmegaConf matches


@pytest.mark.parametrize(
    "cls,value,want",
    [
        (Compression, "zstd", Compression.zstd),
        (Compression, "ZSTD", Compression.zstd),
        (LogLevel, "info", LogLevel.INFO),
        (Policy, Policy.skip, Policy.skip),
        (Dtype, "BFloat16", Dtype.bfloat16),
    ],
)
def test_parse_takes_a_member_or_its_spelling_in_any_case(cls: type[Choice], value, want):
    assert cls.parse(value, "k") is want


def test_parse_names_the_key_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"^persist.local.compress='lz4' is not one of \('none', 'zstd'\)$"):
        Compression.parse("lz4", "persist.local.compress")
    with pytest.raises(ValueError, match=r"format='dcp' is not one of .*shadow restore writes the whole"):
        WeightFormat.parse("dcp", "format")
    with pytest.raises(ValueError, match=r"k=3 is not one of"):
        Policy.parse(3, "k")
    with pytest.raises(ValueError, match=r"k='zstd' is not one of \('torch'"):
        Format.parse(Compression.zstd, "k")  # a member of another set is refused too


def test_configs_hold_members_from_the_command_line_in_any_case():
    cfg = parse(
        ClusterConfig, ["log_level=debug", "log_format=json", "persist.local.dir=/x", "persist.local.compress=ZSTD"]
    )
    assert cfg.log_level is LogLevel.DEBUG and cfg.log_format is LogFormat.json
    assert cfg.persist.local.compress is Compression.zstd
    assert parse(RestoreConfig, ["format=dcp"]).format is Format.dcp
    exp = parse(ExportConfig, ["dtype=float16", "format=torch"])
    assert (exp.dtype, exp.format) == (Dtype.float16, WeightFormat.torch)
    with pytest.raises(UsageError, match=r"log_level='loud' is not one of \('DEBUG', 'INFO', 'WARNING', 'ERROR'\)"):
        parse(ClusterConfig, ["log_level=loud"])


def test_the_persist_config_comes_back_from_the_wire_with_members():
    sent = PersistConfig(LocalTierConfig(dir="/x", compress="zstd")).to_dict()
    back = PersistConfig.from_dict(msgpack.unpackb(msgpack.packb(sent)))
    assert back.local.compress is Compression.zstd and back == PersistConfig.from_dict(sent)
    with pytest.raises(ValueError, match=r"persist.local.compress='gzip' is not one of"):
        PersistConfig.from_dict({"local": {"dir": "/x", "compress": "gzip"}})
