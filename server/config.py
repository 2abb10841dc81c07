"""Server settings: a frozen dataclass, loaded from YAML, then TIERSERVE_<FIELD> environment
variables, then command-line flags (each source overrides the one before). Every value, from
any source, is checked and typed (typed()) before anything heavy runs: a mistake is a one-line
error naming the setting, never a TypeError after the model has loaded."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from tierserve.engine.api import QUANTIZATIONS, SpeculativeConfig, parse_bytes
from tierserve.server.process_env import PROCESS_ENV


@dataclass(frozen=True)
class ServerConfig:
    """Everything `tierserve serve` needs; each field is also a --flag."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """TCP port to listen on."""
    model: str = "smollm2-135m"
    """Engine model: an embedded alias, a .gguf file or a Hugging Face directory."""
    served_model_name: tuple[str, ...] = ()
    """Names clients may use in the `model` field (repeat the flag or separate with commas, as
    vLLM's takes several); responses and metrics carry the first. Unset: `model`."""
    chat_template: str | None = None
    """A Jinja chat template in place of the model's own, for /v1/chat/completions: a file's path
    or the template text itself (as vLLM's --chat-template). A template that does not parse stops
    start-up with the error."""
    quantization: str = "auto"
    """Weight-only quantization (vLLM's flag): none, gguf-exact (keep a GGUF's Q4_0 / Q4_1 /
    Q8_0 blocks; the fp32 path's outputs), gguf (the same blocks, activations rounded to int8
    for integer dot products: llama.cpp's numerics), int8, int4, or auto (the default, for a
    Q4 GGUF on the CPU in float32 where the native kernels are built: gguf on CPUs with AVX2,
    FMA and F16C, 3.2x fp32's decode speed with 96.6% top-1 agreement on the embedded model;
    gguf-exact on others; else none). On the CPU in float32, or on CUDA in bfloat16 (compute capability 8.0+, torch's
    int4 kernel); GET /v1/backends shows the kernels and the weight bytes."""
    prefill_bf16: bool = False
    """Prefill batches (64 tokens or more) run the linear layers and attention in bf16 on AMX's
    tiles (CPUs with amx_bf16 only: elsewhere start-up stops with a one-line error). Faster
    prefill, not the fp32 path's bits: off by default (docs/quantization.md)."""
    tensor_parallel_size: int = 1
    """Shard the model over this many worker processes joined by torch.distributed (vLLM's
    flag; gloo on the CPU, where the threads are split between the ranks; nccl on CUDA, one GPU
    each). The heads must divide by it (docs/parallel.md)."""
    speculative_config: str | None = None
    """Speculative decoding, as vLLM's flag (JSON): {"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model":
    PATH, "num_speculative_tokens": 4}; a YAML mapping works too. Unset: off. A request opts out
    with the header X-Speculative: off (docs/speculative.md)."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto": parse the model's own tool calls out of its output (vLLM's flag;
    needs tool_call_parser). Off: "auto" with tools is a 400; "required" and a named function
    work either way."""
    tool_call_parser: str | None = None
    """The model's tool-call format: hermes or llama3_json (unset: hermes). It parses "auto"
    output and is the format "required" and named-function calls are constrained to."""
    grammar_compile_timeout_s: float = 30.0
    """How long a request's structured-output grammar may compile (CPU seconds of its compile)
    and, apart from that, how long it may wait in the compile queue
    (docs/structured.md#limits-and-fairness); a compile no request waits for is stopped."""
    grammar_compiles_per_key: int = 4
    """Large grammar compiles (texts over 16 KiB, or a compile past 2 s) one API key may have
    queued or running; one more is a 429. Without API keys, all callers share one such limit."""
    grammar_cache_bytes: int = 256 << 20
    """Bound of the compiled-grammar cache in bytes (accepts suffixes: 256MiB); least recently
    used out."""
    grammar_max_bytes: int = 64 << 20
    """Largest compiled grammar (accepts suffixes): a schema that compiles to more is a 400.
    Capped at grammar_cache_bytes (a grammar the cache could not hold would compile twice)."""
    api_key: tuple[str, ...] = ()
    """API keys (repeat the flag or separate with commas); when set, every route but /health and
    /metrics requires `Authorization: Bearer <one of them>`."""
    api_key_file: str | None = None
    """File of more API keys, one a line (blank lines and # comments ignored)."""
    admin_api_key: tuple[str, ...] = ()
    """Operator keys (repeat the flag or separate with commas) for the routes that see across
    tenants (GET /v1/kv/events); an ordinary API key gets 403 there. With api_key set and no
    admin key, those routes are closed to every key."""
    cache_scope: str | None = None
    """Who may share prefix-cache blocks: per-key (each API key's requests hash under a scope
    derived from its digest, so no key hits another key's blocks in the device cache or any
    tier) or shared (every key shares blocks: one trusted tenant). Unset: per-key when API keys
    are configured, else shared."""
    kv_events_token_ids: bool = False
    """KV events carry each stored block's token ids (vLLM's BlockStored.token_ids). Off: events
    carry hashes only. On, whoever reads the events reads every tenant's prompt tokens."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the API (CORS; repeat the flag or separate with commas;
    `*` for any). Preflight requests are answered before the API-key check; the key is still
    required on the request itself. Unset: no CORS headers."""
    auth_health_metrics: bool = False
    """Require an API key on /health and /metrics too (probes and scrapers must then send one)."""
    max_queue: int = 256
    """Requests that may wait beyond max_num_seqs running; more get 429."""
    fair_share: bool = True
    """With API keys, each key is a tenant with an even share of the engine: seats and each
    step's token budget go round the keys with waiting work, so one key's flood waits in its
    own queue (docs/architecture.md#fair-share). Off: first come, first served across keys."""
    max_model_len: int = 8192
    """Longest prompt plus output (capped by the model and the KV cache)."""
    max_num_seqs: int = 64
    """Requests running at once in the engine."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache, sparse decode's block summaries included (accepts suffixes:
    512MiB, 2GiB); unset: 1 GiB on the CPU, on a GPU what --gpu-memory-utilization leaves after
    the weights and a profiled step."""
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
    cuda_graphs: bool = False
    """Replay decode steps from CUDA graphs captured at start-up (GPU, triton decode backend);
    keeps one KV block out of the pool for padded rows. On the CPU: a warning, eager steps."""
    seed: int = 0
    """Sampler seed for requests without a seed."""
    max_n: int = 16
    """Largest `n` (choices per prompt) a request may ask for."""
    max_prompts: int = 64
    """Largest number of prompts in one /v1/completions request."""
    max_prompt_tokens: int | None = None
    """Longest prompt a request may send, in tokens (more get 400); unset: max_model_len - 1."""
    max_tokens_limit: int | None = None
    """Largest max_tokens (or max_completion_tokens) a request may ask for (more get 400), and the
    cap of requests that ask for none; unset: what the context leaves."""
    max_body_bytes: int = 4 << 20
    """Request bodies larger than this get 413 (accepts suffixes: 64KiB, 4MiB)."""
    ssl_certfile: str | None = None
    """Serve HTTPS with this certificate chain (PEM); needs ssl_keyfile. Unset: plain HTTP (put
    TLS in a proxy in front, or set both)."""
    ssl_keyfile: str | None = None
    """The certificate's private key (PEM, unencrypted)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers (a new connection's, or the next one on a
    kept-alive connection); slower connections are closed (slowloris)."""
    max_header_bytes: int = 64 << 10
    """Largest request line plus headers (accepts suffixes: 16KiB); more get 431."""
    log_level: str = "info"
    """Uvicorn and tierserve log level: critical, error, warning, info or debug."""
    kv_tiers: str | None = None
    """KV tiers below the device cache, in lookup order: a comma list of cpu, disk, s3, or none
    (tiers off). Unset: cpu,disk (s3 is opt-in)."""
    cpu_tier_bytes: int | None = None
    """Host memory of the cpu tier (accepts suffixes: 512MiB, 8GiB); unset: an eighth of the
    host's memory, at most 4 GiB."""
    disk_tier_dir: str | None = None
    """Folder of the disk tier (one subfolder per model fingerprint); unset:
    $TIERSERVE_CACHE/kv (~/.cache/tierserve/kv)."""
    disk_tier_bytes: int | None = None
    """Bytes the disk tier may keep (accepts suffixes); unset: a quarter of the free space
    there at start-up, at most 64 GiB."""
    s3_bucket: str | None = None
    """Bucket of the s3 tier (credentials from boto3's standard chain: AWS_* variables, ...)."""
    s3_prefix: str = "tierserve-kv"
    """First component of the s3 tier's object keys."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint URL (SeaweedFS, MinIO, ...); unset: AWS."""
    s3_region: str | None = None
    """Region of the s3 tier's bucket."""
    kv_load_timeout_s: float | None = None
    """Abandon a tier load's reads after this many seconds (or the request's TTFT budget, if
    sooner) and recompute the rest; unset: 30."""
    disk_tier_error_backoff_s: float | None = None
    """After a failed disk write (full, read-only), disk stores pause this long; unset: 30."""
    s3_connect_timeout_s: float | None = None
    """TCP connect timeout of one s3 attempt; unset: 2."""
    s3_read_timeout_s: float | None = None
    """Socket read timeout of one s3 attempt; unset: 5."""
    s3_max_attempts: int | None = None
    """Attempts per s3 request, the first included; unset: 2."""
    s3_probe_batch: int | None = None
    """s3 HEAD requests in flight at once during a lookup; unset: 8."""
    s3_create_bucket: bool | None = None
    """Create the s3 bucket before the first write if it is missing; unset: yes."""
    s3_breaker_threshold: int | None = None
    """Consecutive failed s3 requests that open the circuit breaker; unset: 3."""
    s3_breaker_backoff_s: float | None = None
    """First wait before an open breaker lets one probe through (doubles per failure); unset: 5."""
    s3_breaker_max_backoff_s: float | None = None
    """Cap of the breaker's wait; unset: 60."""
    kv_store_queue_depth: int | None = None
    """Pending store jobs per tier (more are dropped and counted, never waited for); unset: 64."""
    kv_store_workers: int | None = None
    """Writer threads per tier; unset: 1."""
    kv_load_workers: int | None = None
    """Threads reading tier payloads for loads, shared by all tiers; unset: 4."""
    kv_event_log_size: int | None = None
    """KV events kept for GET /v1/kv/events readers that fall behind; unset: 10000."""
    default_kv_load_tiers: str | None = None
    """X-KV-Load-Tiers for requests that send none (tier names, all or none)."""
    default_kv_store_tiers: str | None = None
    """X-KV-Store-Tiers for requests that send none."""
    default_slo_class: str | None = None
    """X-SLO-Class for requests that send none: interactive or batch."""
    default_slo_ttft_ms: float | None = None
    """X-SLO-TTFT-Ms for requests that send none."""
    sparse_topk_blocks: int | None = None
    """Sparse top-k decode: KV blocks each decode attends per KV head (first and newest included);
    unset with sparse_topk_ratio unset: dense decode (docs/sparse.md)."""
    sparse_topk_ratio: float | None = None
    """Sparse top-k decode as a fraction of each sequence's blocks (0 < ratio <= 1)."""
    sparse_min_context: int = 1024
    """Sequences with fewer context tokens decode densely."""
    sparse_dense_layers: int = 2
    """The first layers stay dense under sparse decode."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # e.g. "x, y" for api_key: two keys, not characters
            object.__setattr__(self, f.name, typed(f.name, getattr(self, f.name)))
        for name in (*_AT_LEAST_ONE, *_CHECKED):
            _check(name, getattr(self, name))
        if self.tool_call_parser is not None:
            from tierserve.server.tool_parsers import tool_parser
            tool_parser(self.tool_call_parser)  # an unknown name lists the valid ones
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or "
                             "llama3_json), as in vLLM")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        SpeculativeConfig.parse(self.speculative_config)  # a bad one is a one-line ValueError
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be above 0")
        if self.cache_scope == "per-key" and not self.api_key:
            raise ValueError("cache_scope per-key needs api_key: without keys every caller is "
                             "the same tenant")

    def describe(self) -> str:
        """The settings that differ from the defaults, in one line; API keys are counted, not
        shown."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                shown = f"<{len(value)} keys>" if f.name in _KEY_FIELDS else value
                parts.append(f"{f.name}={shown}")
        return " ".join(parts) or "all defaults"

    @property
    def scope_per_key(self) -> bool:
        """Each API key's requests hash under a scope of their own (cache_scope)."""
        return (self.cache_scope or ("per-key" if self.api_key else "shared")) == "per-key"

    @property
    def model_name(self) -> str:
        """The name responses and metrics carry."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use."""
        return self.served_model_name or (self.model,)

    def engine_kwargs(self) -> dict[str, Any]:
        """Flat keyword arguments for engine.llm.build_config."""
        keys = ("model", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "kv_cache_memory_bytes", "block_size", "enable_prefix_caching", "device", "dtype",
                "gpu_memory_utilization",
                "kv_cache_dtype", "kv_cache_scale", "attention_backend", "backend_profile",
                "num_threads", "seed", "kv_tiers", "cpu_tier_bytes", "disk_tier_dir",
                "disk_tier_bytes", "s3_bucket", "s3_prefix", "s3_endpoint_url", "s3_region",
                "sparse_topk_blocks", "sparse_topk_ratio", "sparse_min_context",
                "sparse_dense_layers", "cuda_graphs", "kv_events_token_ids", "quantization",
                "prefill_bf16", "speculative_config", "tensor_parallel_size", "fair_share",
                "grammar_compiles_per_key", "grammar_cache_bytes", "grammar_max_bytes",
                *TIER_KNOBS)
        return {k: getattr(self, k) for k in keys} | {"kv_tiers": self.tier_names}

    @property
    def tier_names(self) -> str | None:
        """kv_tiers resolved: unset means cpu,disk; none (or empty) means no tiers."""
        if self.kv_tiers is None:
            return DEFAULT_TIERS
        return None if self.kv_tiers.strip().lower() in ("", "none") else self.kv_tiers


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
BYTE_FIELDS = ("kv_cache_memory_bytes", "cpu_tier_bytes", "disk_tier_bytes", "max_body_bytes",
               "max_header_bytes", "grammar_cache_bytes", "grammar_max_bytes")
"""Settings that accept size suffixes (512MiB, 2GiB)."""
ENV_PREFIX = "TIERSERVE_"

"""Each setting is also the variable TIERSERVE_<FIELD NAME IN CAPITALS>; other TIERSERVE_* names
(TIERSERVE_CACHE, TIERSERVE_SPIN_US, ...) are not settings and are left alone here."""
CONFIG_ENV = "TIERSERVE_CONFIG"
"""The YAML file (or preset name) when --config is not given."""
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")
_AT_LEAST_ONE = ("max_prompt_tokens", "max_tokens_limit", "max_header_bytes",
                 "tensor_parallel_size", "grammar_compiles_per_key", "grammar_cache_bytes",
                 "grammar_max_bytes")
_CHECKED = ("cache_scope", "header_timeout_s", "port", "log_level")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_KEY_FIELDS = ("api_key", "admin_api_key")
"""Secrets: counted, never shown, in the start-up line."""
CACHE_SCOPES = ("per-key", "shared")
TIER_KNOBS = ("kv_load_timeout_s", "disk_tier_error_backoff_s", "s3_connect_timeout_s",
              "s3_read_timeout_s", "s3_max_attempts", "s3_probe_batch", "s3_create_bucket",
              "s3_breaker_threshold", "s3_breaker_backoff_s", "s3_breaker_max_backoff_s",
              "kv_store_queue_depth", "kv_store_workers", "kv_load_workers", "kv_event_log_size")
"""The tier settings beyond sizes and places (engine.llm.TIER_ARGS maps them to TierConfig)."""
DEFAULT_TIERS = "cpu,disk"
"""The tiers a server runs when kv_tiers is not set (every README example needs them)."""


def _check(name: str, value: Any) -> None:
    if name in _AT_LEAST_ONE and value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    if name == "cache_scope" and value is not None and value not in CACHE_SCOPES:
        raise ValueError(f"cache_scope must be one of {', '.join(CACHE_SCOPES)}, got {value!r}")
    if name == "header_timeout_s" and value is not None and not value > 0:
        raise ValueError(f"header_timeout_s must be above 0, got {value}")
    if name == "port" and not 0 <= value <= 65535:
        raise ValueError(f"port must be between 0 and 65535, got {value}")
    if name == "log_level" and value.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")


def _kind(hint: Any) -> tuple[Any, bool]:
    """A field's type without `| None`, and whether None is allowed."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None)), True
    return (tuple if typing.get_origin(hint) is tuple else hint), False


_KINDS = {name: _kind(hint) for name, hint in typing.get_type_hints(ServerConfig).items()}
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             tuple: "a string or a list of strings"}


def typed(name: str, value: Any) -> Any:
    """`value` as setting `name`'s type. Text converts as a TIERSERVE_* variable's does (a flag's,
    a quoted YAML value's), an integer passes for a number; anything else is a one-line
    ValueError naming the setting and the type it expects, so a YAML `max_num_seqs: lots` stops
    start-up instead of failing in the engine after the model has loaded."""
    kind, optional = _KINDS[name]
    _some_key(name, value)
    if value is None:
        if optional or kind is tuple:
            return () if kind is tuple else None
        raise ValueError(f"{name}: expected {_EXPECTED[kind]}, got nothing (null)")
    if isinstance(value, str):
        try:
            return _from_text(name, kind, value.strip() if kind is not str else value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if _fits(name, kind, value):
        return float(value) if kind is float else _as_text(name, value)
    wanted = "a byte size (an integer, or text such as 512MiB)" if name in BYTE_FIELDS else \
        _EXPECTED[kind]
    raise ValueError(f"{name}: expected {wanted}, got {value!r}")


def _some_key(name: str, value: Any) -> None:
    """A key setting that was given but holds no key is an error, not an open server."""
    if name in _KEY_FIELDS and value not in (None, (), []) and not split_keys(value):
        raise ValueError(f"{name} is set but holds no key (an empty key would leave the server "
                         "open)")


def _fits(name: str, kind: Any, value: Any) -> bool:
    """A non-text value the setting takes as it is (bool is an int to Python, not to YAML)."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, (list, tuple))
    if kind is str:
        return name == "speculative_config" and isinstance(value, dict)  # a YAML mapping
    return isinstance(value, int) or (kind is float and isinstance(value, float))


def _as_text(name: str, value: Any) -> Any:
    """The text form a setting keeps of a YAML list or mapping; anything else as it is."""
    if isinstance(value, dict):
        return json.dumps(value)
    return split_keys(value) if isinstance(value, (list, tuple)) else value


def unknown_setting(name: str) -> str:
    """'unknown setting NAME' with the nearest valid name, as git suggests a mistyped command,
    rather than all 80-odd of them (`tierserve serve --help` lists those)."""
    close = difflib.get_close_matches(name, list(FIELDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else " (`tierserve serve --help` lists them)"
    return f"unknown setting {name!r}{hint}"


def env_typos(environ: Mapping[str, str]) -> list[str]:
    """A warning for each TIERSERVE_* variable that is no setting and no variable tierserve
    reads, but is close to one (TIERSERVE_MAX_QUEUE misspelt): it would be ignored in silence.
    Not an error: the prefix is not reserved, and other tools may use it."""
    known = {ENV_PREFIX + n.upper() for n in FIELDS} | {CONFIG_ENV} | set(PROCESS_ENV)
    tails = sorted(k.removeprefix(ENV_PREFIX) for k in known)  # the shared prefix would match
    out = []
    for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var.removeprefix(ENV_PREFIX), tails, n=1, cutoff=0.8)
        if close:
            out.append(f"{var} is not a setting (ignored); did you mean {ENV_PREFIX}{close[0]}?")
    return out


def split_keys(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """API keys from a comma list, or from a list of comma lists (a repeated flag, YAML)."""
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else \
        [p for v in value for p in str(v).split(",")]
    return tuple(p.strip() for p in parts if p.strip())


def read_key_file(path: str) -> tuple[str, ...]:
    """One key a line; blank lines and lines starting with # are skipped."""
    lines = Path(path).read_text().splitlines()
    return tuple(ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#"))


def env_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The TIERSERVE_<FIELD> variables that are set and not empty, converted to each field's type;
    a value that does not convert is a ValueError naming the variable."""
    hints = typing.get_type_hints(ServerConfig)
    out: dict[str, Any] = {}
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        raw = environ.get(var, "").strip()
        if raw:
            try:
                _some_key(name, raw)
                out[name] = _from_text(name, hints[name], raw)
                _check(name, out[name])
            except ValueError as e:
                raise ValueError(f"{var}: {e}") from None
    return out


def _from_text(name: str, kind: Any, raw: str) -> Any:
    kind = _kind(kind)[0]
    if kind is tuple:
        return split_keys(raw)
    if name in BYTE_FIELDS:
        return parse_bytes(raw)
    if kind is bool:
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}, got {raw!r}")
        return raw.lower() in _TRUE
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, "
                             f"got {raw!r}") from None
    return raw


def load_config(path: str | Path | None, overrides: dict[str, Any],
                environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Defaults, then the YAML file, then TIERSERVE_<FIELD> variables in `environ`, then overrides
    (flags; None values are ignored). `path` is a file or the name of a preset shipped in
    tierserve.configs ("default"); None: TIERSERVE_CONFIG, if set. The keys in api_key_file join
    api_key's."""
    path = path if path is not None else (environ.get(CONFIG_ENV) or None)
    values: dict[str, Any] = {} if path is None else read_yaml(path)
    values.update(env_settings(environ))
    for name, value in overrides.items():
        if name not in FIELDS:
            raise ValueError(unknown_setting(name))
        if value is not None:
            values[name] = typed(name, value)
    values["api_key"] = _api_keys(values.get("api_key"), values.get("api_key_file"))
    values["admin_api_key"] = _api_keys(values.get("admin_api_key"), None)
    if (values.get("ssl_certfile") is None) != (values.get("ssl_keyfile") is None):
        raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")
    return ServerConfig(**values)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML file (or a preset's name), each typed. A syntax error, a key that
    is no setting or a value of the wrong type is a one-line ValueError that begins with the
    file and line (`c.yaml:3: max_num_seqs: expected an integer, got 'lots'`)."""
    from tierserve.configs import resolve

    file = resolve(path)
    text = file.read_text()
    try:
        data, lines = yaml.safe_load(text), _key_lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise ValueError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a mapping of settings (key: value lines)")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        try:
            if name not in FIELDS:
                raise ValueError(unknown_setting(name))
            out[name] = typed(name, value)
        except ValueError as e:
            raise ValueError(f"{file}:{lines.get(key, '?')}: {e}") from None
    return out


def _key_lines(text: str) -> dict[Any, int]:
    """{top-level key: its line number (from 1)} of a YAML document, for error messages."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return {}
    loader = yaml.SafeLoader("")
    return {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}


def _api_keys(given: Any, key_file: str | None) -> tuple[str, ...]:
    """The keys given (typed() refused a setting that holds none) and those in key_file."""
    keys = split_keys(given)
    if key_file:
        try:
            found = read_key_file(key_file)
        except OSError as e:
            raise ValueError(f"api_key_file: cannot read {key_file}: {e.strerror}") from None
        if not found:
            raise ValueError(f"api_key_file: {key_file} holds no key")
        keys += found
    return keys


def read_chat_template(value: str) -> str:
    """--chat-template's value as template text: the file it names, else the value itself when
    it holds Jinja markup; anything else is a ValueError (a mistyped path, say)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")
