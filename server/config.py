"""Server settings: a frozen dataclass, loaded from YAML and overridden by command-line flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tierserve.engine.config import parse_bytes


@dataclass(frozen=True)
class ServerConfig:
    """Everything `tierserve serve` needs; each field is also a --flag."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """TCP port to listen on."""
    model: str = "smollm2-135m"
    """Engine model: an embedded alias, a .gguf file or a Hugging Face directory."""
    served_model_name: str | None = None
    """Name clients use in the `model` field; defaults to `model`."""
    api_key: str | None = None
    """When set, /v1/*, /tokenize and /detokenize require `Authorization: Bearer <key>`."""
    max_queue: int = 256
    """Requests that may wait beyond max_num_seqs running; more get 429."""
    max_model_len: int = 8192
    """Longest prompt plus output (capped by the model and the KV cache)."""
    max_num_seqs: int = 64
    """Requests running at once in the engine."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache (accepts suffixes: 512MiB, 2GiB); unset: 1 GiB on the CPU, on a GPU
    what --gpu-memory-utilization leaves after the weights and a profiled step."""
    block_size: int = 16
    """Tokens per KV block."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes."""
    device: str = "auto"
    """auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on GPUs of capability >= 8.0, float16 on older ones, float32
    on the CPU), float32, float16 or bfloat16."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory tierserve may use; the KV cache gets what the weights and
    activations leave (ignored on the CPU or when kv_cache_memory_bytes is set)."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto (the compute dtype), float16, bfloat16 or fp8_e4m3."""
    kv_cache_scale: float = 1.0
    """Dequantization scale of an fp8_e4m3 KV cache."""
    attention_backend: str | None = None
    """Force an attention backend (NAME or prefill=NAME,decode=NAME); see `tierserve route`."""
    backend_profile: str | None = None
    """Timings from `tierserve bench-backends` (default ~/.cache/tierserve/backend_profile.json)."""
    num_threads: int | None = None
    """Torch threads; None uses every core available."""
    seed: int = 0
    """Sampler seed for requests without a seed."""
    max_n: int = 16
    """Largest `n` (choices per prompt) a request may ask for."""
    max_prompts: int = 64
    """Largest number of prompts in one /v1/completions request."""
    max_body_bytes: int = 4 << 20
    """Request bodies larger than this get 413."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    log_level: str = "info"
    """Uvicorn and tierserve log level."""
    kv_tiers: str | None = None
    """KV tiers below the device cache, in lookup order: a comma list of cpu, disk, s3."""
    cpu_tier_bytes: int = 4 << 30
    """Host memory of the cpu tier (accepts suffixes: 512MiB, 8GiB)."""
    disk_tier_dir: str | None = None
    """Folder of the disk tier (one subfolder per model fingerprint)."""
    disk_tier_bytes: int = 64 << 30
    """Bytes the disk tier may keep (accepts suffixes)."""
    s3_bucket: str | None = None
    """Bucket of the s3 tier (credentials from boto3's standard chain: AWS_* variables, ...)."""
    s3_prefix: str = "tierserve-kv"
    """First component of the s3 tier's object keys."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint URL (SeaweedFS, MinIO, ...); unset: AWS."""
    s3_region: str | None = None
    """Region of the s3 tier's bucket."""
    default_kv_load_tiers: str | None = None
    """X-KV-Load-Tiers for requests that send none (tier names, all or none)."""
    default_kv_store_tiers: str | None = None
    """X-KV-Store-Tiers for requests that send none."""
    default_slo_class: str | None = None
    """X-SLO-Class for requests that send none: interactive or batch."""
    default_slo_ttft_ms: float | None = None
    """X-SLO-TTFT-Ms for requests that send none."""

    def default_hint_headers(self) -> dict[str, str]:
        """The defaults above as the request headers they stand in for."""
        pairs = (("X-KV-Load-Tiers", self.default_kv_load_tiers),
                 ("X-KV-Store-Tiers", self.default_kv_store_tiers),
                 ("X-SLO-Class", self.default_slo_class),
                 ("X-SLO-TTFT-Ms", self.default_slo_ttft_ms))
        return {k: str(v) for k, v in pairs if v is not None}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """Flat keyword arguments for engine.llm.build_config."""
        keys = ("model", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "kv_cache_memory_bytes", "block_size", "enable_prefix_caching", "device", "dtype",
                "gpu_memory_utilization",
                "kv_cache_dtype", "kv_cache_scale", "attention_backend", "backend_profile",
                "num_threads", "seed", "kv_tiers", "cpu_tier_bytes", "disk_tier_dir",
                "disk_tier_bytes", "s3_bucket", "s3_prefix", "s3_endpoint_url", "s3_region")
        return {k: getattr(self, k) for k in keys}


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
BYTE_FIELDS = ("kv_cache_memory_bytes", "cpu_tier_bytes", "disk_tier_bytes")
"""Settings that accept size suffixes (512MiB, 2GiB)."""
def load_config(path: str | Path | None, overrides: dict[str, Any]) -> ServerConfig:
    """YAML values, then overrides (None values in overrides are ignored). `path` is a file or the
    name of a preset shipped in tierserve.configs ("default")."""
    from tierserve.configs import resolve

    values: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(resolve(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; valid: {sorted(FIELDS)}")
    for key in BYTE_FIELDS:
        if values.get(key) is not None:
            values[key] = parse_bytes(values[key])
    return ServerConfig(**values)
