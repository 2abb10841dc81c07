"""Server settings: no model, milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.server.cli import build_parser
from tierserve.server.config import ServerConfig, load_config, parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_default_yaml_matches_dataclass_defaults():
    cfg = load_config(ROOT / "configs" / "default.yaml", {})
    assert cfg == ServerConfig()
    assert (cfg.host, cfg.port, cfg.model_name) == ("127.0.0.1", 8000, "smollm2-135m")


def test_flags_override_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("port: 9000\nmax_queue: 3\nkv_cache_memory_bytes: 512MiB\n")
    args = build_parser().parse_args(["serve", "--config", str(p), "--max-queue", "7",
                                      "--served-model-name", "m", "--no-enable-prefix-caching"])
    cfg = load_config(args.config, {k: getattr(args, k) for k in ServerConfig.__dataclass_fields__})
    assert (cfg.port, cfg.max_queue, cfg.model_name) == (9000, 7, "m")
    assert cfg.kv_cache_memory_bytes == 512 << 20 and cfg.enable_prefix_caching is False


def test_unknown_setting_lists_valid_ones(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown settings.*'port'"):
        load_config(p, {})


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes(123) == 123 and parse_bytes("1k") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_tier_settings_take_suffixes_and_reach_the_engine_config(tmp_path):
    from tierserve.engine.llm import build_config

    cfg = load_config(ROOT / "configs" / "tiers.example.yaml",
                      {"disk_tier_dir": str(tmp_path), "cpu_tier_bytes": "512MiB"})
    assert cfg.kv_tiers == "cpu,disk,s3" and cfg.cpu_tier_bytes == 512 << 20
    tiers = build_config(**cfg.engine_kwargs()).kv_tiers
    assert tiers.tiers == ("cpu", "disk", "s3") and tiers.cpu_bytes == 512 << 20
    assert tiers.disk_dir == str(tmp_path) and tiers.s3_bucket == cfg.s3_bucket
    # no tier setting: cpu and disk, bounded by the host; "none" turns them off
    default = build_config(**ServerConfig().engine_kwargs()).kv_tiers
    assert default.tiers == ("cpu", "disk") and 0 < default.cpu_bytes <= 4 << 30
    assert 0 < default.disk_bytes <= 64 << 30
    assert build_config(**ServerConfig(kv_tiers="none").engine_kwargs()).kv_tiers is None


def test_default_hints_are_built_once_from_the_settings_and_named_when_bad():
    from tierserve.engine.core.kv_hints import KVHints, SloClass
    from tierserve.engine.kv_tiers.media import Locality, Medium, TierDescriptor
    from tierserve.server.errors import ApiError
    from tierserve.server.policy import default_hints

    tiers = [TierDescriptor("cpu", Medium.CPU, Locality.LOCAL),
             TierDescriptor("disk", Medium.STORAGE, Locality.LOCAL)]
    cfg = ServerConfig(default_slo_class="batch", default_slo_ttft_ms=250.0,
                       default_kv_store_tiers="cpu")
    assert default_hints(cfg, tiers) == KVHints(store_tiers=("cpu",), ttft_budget_ms=250.0,
                                                slo_class=SloClass.BATCH)
    assert default_hints(ServerConfig(), tiers).empty
    # a request that sends only its budget keeps the other defaults, field by field
    merged = KVHints(ttft_budget_ms=90.0).over(default_hints(cfg, tiers))
    assert merged.store_tiers == ("cpu",) and merged.ttft_budget_ms == 90.0
    with pytest.raises(ApiError) as e:
        default_hints(ServerConfig(default_kv_load_tiers="cpu,s3"), tiers)
    assert e.value.param == "default_kv_load_tiers" and "unknown tier 's3'" in e.value.message
