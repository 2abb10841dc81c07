"""Server settings and header recording: no model, milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.server.cli import build_parser
from tierserve.server.config import ServerConfig, load_config, parse_bytes
from tierserve.server.policy import policy_from_headers

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


def test_policy_records_only_kv_headers():
    pol = policy_from_headers({"X-SLO-TTFT-MS": "200", "x-kv-load-tiers": "cpu,disk",
                               "authorization": "Bearer k"})
    assert pol.headers == {"x-slo-ttft-ms": "200", "x-kv-load-tiers": "cpu,disk"}
    assert policy_from_headers({}).empty
