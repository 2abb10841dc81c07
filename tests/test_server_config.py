"""Server settings: no model, milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierserve.server.cli import build_parser
from tierserve.server.config import ServerConfig, env_typos, load_config, parse_bytes

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


def test_unknown_setting_names_the_nearest_one(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("port: 9000\nprot: 1\n")
    with pytest.raises(ValueError) as e:
        load_config(p, {})
    assert str(e.value) == f"{p}:2: unknown setting 'prot'; did you mean 'port'?"
    p.write_text("zzz: 1\n")  # nothing near: where the list is, not all 80-odd names
    with pytest.raises(ValueError, match="unknown setting 'zzz' \\(`tierserve serve --help`"):
        load_config(p, {})


@pytest.mark.parametrize("line,error", [
    ("max_num_seqs: lots", "max_num_seqs: expected an integer, got 'lots'"),
    ("max_num_seqs: 8.5", "max_num_seqs: expected an integer, got 8.5"),
    ("max_num_seqs: true", "max_num_seqs: expected an integer, got True"),
    ("port:", "port: expected an integer, got nothing (null)"),
    ("cuda_graphs: 1", "cuda_graphs: expected true or false, got 1"),
    ("gpu_memory_utilization: [0.5]", "gpu_memory_utilization: expected a number, got [0.5]"),
    ("s3_bucket: 2024", "s3_bucket: expected a string, got 2024"),
    ("kv_cache_memory_bytes: lots", "kv_cache_memory_bytes: not a byte size: 'lots'"),
])
def test_a_yaml_value_of_the_wrong_type_names_file_line_and_key(tmp_path, line, error):
    """Caught before anything loads, rather than a TypeError from the engine minutes later."""
    p = tmp_path / "c.yaml"
    p.write_text(f"host: 127.0.0.1\n{line}\n")
    with pytest.raises(ValueError) as e:
        load_config(p, {}, environ={})
    assert str(e.value).startswith(f"{p}:2: {error}"), e.value


def test_yaml_values_are_typed_as_flags_and_variables_are(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("max-num-seqs: '8'\ngpu_memory_utilization: 1\ncuda_graphs: yes\n"
                 "served_model_name: [a, b]\n"
                 "speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
                 "kv_cache_memory_bytes: 512MiB\napi_key: null\n")
    cfg = load_config(p, {}, environ={})
    assert (cfg.max_num_seqs, cfg.gpu_memory_utilization, cfg.cuda_graphs) == (8, 1.0, True)
    assert isinstance(cfg.gpu_memory_utilization, float) and cfg.served_model_name == ("a", "b")
    assert json.loads(cfg.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}
    assert cfg.api_key == ()
    assert cfg.kv_cache_memory_bytes == 512 << 20


def test_a_yaml_syntax_error_is_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("port: 9000\nmodel: smollm2-135m\n  max_num_seqs: 8\n")
    with pytest.raises(ValueError) as e:
        load_config(p, {}, environ={})
    assert str(e.value) == f"{p}:3:15: not valid YAML: mapping values are not allowed here"
    p.write_text("- port\n")
    with pytest.raises(ValueError, match="expected a mapping of settings"):
        load_config(p, {}, environ={})


def test_settings_checked_in_the_config_itself():
    """A config built in code gets the same checks as one from YAML."""
    assert ServerConfig(max_num_seqs="8", kv_cache_memory_bytes="1GiB").max_num_seqs == 8
    for kwargs, error in [({"max_num_seqs": "lots"}, "max_num_seqs: expected an integer"),
                          ({"port": 70000}, "port must be between 0 and 65535, got 70000"),
                          ({"log_level": "loud"}, "log_level must be one of critical, error")]:
        with pytest.raises(ValueError, match=error):
            ServerConfig(**kwargs)


def test_a_key_setting_that_holds_no_key_is_refused_from_every_source(tmp_path):
    """Never an open server by mistake: a flag, a variable, a YAML value or the config itself."""
    (tmp_path / "c.yaml").write_text("api_key: ' , '\n")
    attempts = [lambda: load_config(None, {"api_key": [","]}, environ={}),
                lambda: load_config(None, {}, environ={"TIERSERVE_API_KEY": " , "}),
                lambda: load_config(tmp_path / "c.yaml", {}, environ={}),
                lambda: ServerConfig(admin_api_key=",")]
    for attempt in attempts:
        with pytest.raises(ValueError, match="api_key is set but holds no key"):
            attempt()


def test_a_mistyped_variable_gets_a_hint_and_is_otherwise_ignored():
    env = {"TIERSERVE_MAX_QEUE": "5", "TIERSERVE_SPIN_USS": "0", "TIERSERVE_CACHE": "/x",
           "TIERSERVE_MAX_QUEUE": "7", "TIERSERVE_SOMETHING_ELSE": "1"}
    assert env_typos(env) == [
        "TIERSERVE_MAX_QEUE is not a setting (ignored); did you mean TIERSERVE_MAX_QUEUE?",
        "TIERSERVE_SPIN_USS is not a setting (ignored); did you mean TIERSERVE_SPIN_US?"]
    assert load_config(None, {}, environ=env).max_queue == 7


def _parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_flags_are_never_abbreviated_and_a_typo_names_the_real_one(capsys):
    assert _parse_error(capsys, "serve", "--max-num-seq", "8") == \
        "tierserve serve: unknown flag --max-num-seq (did you mean --max-num-seqs?)\n"
    assert _parse_error(capsys, "serve", "--max-num-seqs", "lots") == \
        "tierserve serve: argument --max-num-seqs: expected an integer, got 'lots'\n"
    assert _parse_error(capsys, "generate", "hi", "--max-token", "4") == \
        "tierserve generate: unknown flag --max-token (did you mean --max-tokens?)\n"
    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--cpu-tier-bytes", "1MiB"])
    assert (args.max_num_seqs, args.cpu_tier_bytes) == (8, 1 << 20)


def test_the_model_may_be_given_positionally():
    args = build_parser().parse_args(["serve", "m", "--port", "1"])
    assert (args.model_arg, args.model, args.port) == ("m", None, 1)


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
    from tierserve.engine.core.tier_descriptor import Locality, Medium, TierDescriptor
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
