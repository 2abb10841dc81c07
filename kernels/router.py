"""Pick the attention backend per phase for a device and a model shape, and say why.

Each backend declares Capabilities; the router rejects those that cannot run with a reason. An
explicit choice is honoured if valid and fails with the reasons if not. Otherwise, among the
valid ones, the fastest measured on this machine (the bench-backends profile) wins, else the
first in the device's priority list for the phase."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

from tierserve.kernels.base import Capabilities
from tierserve.kernels.kv_dtype import MODEL_DTYPE_NAMES, canonical_kv_dtype
from tierserve.kernels.profile import shape_key
from tierserve.kernels.registry import BACKENDS, backend_class

PHASES = ("prefill", "decode")
PRIORITY = {
    ("cpu", "prefill"): ["cpu_native", "torch_sdpa", "torch_ref"],
    ("cpu", "decode"): ["cpu_native", "torch_sdpa", "torch_ref"],
    ("cuda", "prefill"): ["flashinfer", "torch_sdpa", "triton", "torch_ref"],
    ("cuda", "decode"): ["flashinfer", "triton", "torch_sdpa", "torch_ref"],
}
FALLBACK_PRIORITY = ["torch_sdpa", "torch_ref"]
TIE = 1.10
"""A measured backend displaces a higher-priority one only when more than 10% faster (noise)."""


@dataclass(frozen=True)
class RouteQuery:
    device_type: str
    dtype: torch.dtype
    kv_dtype: str
    """'auto' or a KV dtype name (see kernels.kv_dtype)."""
    head_dim: int
    num_heads: int
    num_kv_heads: int
    page_size: int
    phase: str = "decode"
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None off CUDA."""
    sparse: bool = False
    sliding_window: bool = False
    """The model has sliding-window layers (Gemma 3)."""

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_name(self) -> str:
        return canonical_kv_dtype(self.kv_dtype, self.dtype)

    @property
    def shape_key(self) -> str:
        return shape_key(self.device_type, self.capability, self.dtype, self.kv_name,
                         self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)


@dataclass
class Route:
    backend: str
    rejected: dict[str, str] = field(default_factory=dict)
    """Every backend not chosen, with the reason."""
    basis: str = "priority"
    """Why this one among the valid: 'override', 'profile' or 'priority'."""

    def to_json(self) -> dict:
        return {"backend": self.backend, "basis": self.basis, "rejected": self.rejected}


def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _cc(c: tuple[int, int]) -> str:
    return f"{c[0]}.{c[1]}"


def _capability_reason(caps: Capabilities, q: RouteQuery) -> str | None:
    if q.device_type != "cuda" or q.capability is None:
        return None
    if caps.min_capability and q.capability < caps.min_capability:
        return f"compute capability {_cc(q.capability)} below {_cc(caps.min_capability)}"
    if caps.max_capability and q.capability > caps.max_capability:
        return f"compute capability {_cc(q.capability)} above {_cc(caps.max_capability)}"
    dtype = MODEL_DTYPE_NAMES.get(q.dtype, str(q.dtype))
    for what, need in caps.min_capability_for:
        if what in (dtype, q.kv_name) and q.capability < need:
            return f"{what} needs compute capability {_cc(need)} (have {_cc(q.capability)})"
    return None


def reject_reason(caps: Capabilities, q: RouteQuery,
                  installed: Callable[[str], bool] = _importable) -> str | None:
    """Why a backend with these capabilities cannot run q, or None if it can."""
    kv_ok = q.kv_name in caps.kv_dtypes or (
        "auto" in caps.kv_dtypes and q.kv_name == MODEL_DTYPE_NAMES.get(q.dtype))
    checks = [
        (q.device_type in caps.device_types, f"device {q.device_type} not in {caps.device_types}"),
        (q.dtype in caps.dtypes, f"dtype {str(q.dtype).removeprefix('torch.')} not supported"),
        (kv_ok, f"KV dtype {q.kv_name} not in {caps.kv_dtypes}"),
        (caps.head_dims is None or q.head_dim in caps.head_dims,
         f"head dim {q.head_dim} not in {caps.head_dims}"),
        (caps.gqa_groups is None or q.group in caps.gqa_groups,
         f"GQA group {q.group} not in {caps.gqa_groups}"),
        (caps.page_sizes is None or q.page_size in caps.page_sizes,
         f"page size {q.page_size} not in {caps.page_sizes}"),
        (q.phase in caps.phases, f"phase {q.phase} not supported"),
        (not q.sparse or caps.sparse, "no sparse attention support"),
        (not q.sliding_window or caps.sliding_window,
         "no sliding-window attention (the model has windowed layers)"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    why = _capability_reason(caps, q)
    if why:
        return why
    missing = [p for p in caps.requires if not installed(p)]
    return f"not installed ({', '.join(missing)})" if missing else None


def parse_override(override: str | None) -> dict[str, str]:
    """'NAME' (both phases) or 'prefill=NAME,decode=NAME' -> {phase: name}."""
    if not override:
        return {}
    if "=" not in override:
        return {p: override for p in PHASES}
    out = {}
    for part in override.split(","):
        phase, _, name = part.partition("=")
        if phase.strip() not in PHASES:
            raise ValueError(f"attention backend override {override!r}: phase {phase!r} is not "
                             f"one of {PHASES}")
        out[phase.strip()] = name.strip()
    return out


def route(q: RouteQuery, override: str | None = None,
          profile: dict[str, dict[str, dict[str, float]]] | None = None,
          installed: Callable[[str], bool] = _importable) -> Route:
    """The backend for q.phase. override: one backend name (must be valid for q or ValueError).
    profile: bench-backends timings (kernels.profile.load_profile)."""
    order = PRIORITY.get((q.device_type, q.phase), FALLBACK_PRIORITY)
    names = order + [n for n in BACKENDS if n not in order]
    if override is not None and override not in BACKENDS:
        raise ValueError(f"unknown attention backend {override!r} (valid: {', '.join(BACKENDS)})")
    reasons = {n: reject_reason(backend_class(n).capabilities, q, installed) for n in names}
    valid = [n for n in names if reasons[n] is None]
    if override is not None:
        if reasons[override] is not None:
            raise ValueError(f"attention backend {override} cannot run {q.phase} here: "
                             f"{reasons[override]}")
        return Route(override, {n: r or f"not chosen (--attention-backend {override})"
                                for n, r in reasons.items() if n != override}, "override")
    if not valid:
        raise ValueError(f"no attention backend can run {q.phase} here: " +
                         "; ".join(f"{n}: {r}" for n, r in reasons.items()))
    timings = (profile or {}).get(q.shape_key, {}).get(q.phase, {})
    measured = [n for n in valid if n in timings]
    if measured:
        best_ms = min(timings[n] for n in measured)
        chosen = next(n for n in measured if timings[n] <= best_ms * TIE)  # priority order
        best_ms, basis = timings[chosen], "profile"
    else:
        chosen, basis = valid[0], "priority"
    rejected = {}
    for n in names:
        if n == chosen:
            continue
        if reasons[n] is not None:
            rejected[n] = reasons[n]
        elif basis == "profile" and n in timings and timings[n] < best_ms:
            rejected[n] = (f"not >10% faster here than {chosen} ({timings[n]:.3g} ms vs "
                           f"{best_ms:.3g} ms), lower priority")
        elif basis == "profile" and n in timings:
            rejected[n] = f"slower here ({timings[n]:.3g} ms vs {best_ms:.3g} ms for {chosen})"
        elif basis == "profile":
            rejected[n] = f"not measured here ({chosen} is the fastest measured)"
        else:
            rejected[n] = f"lower priority than {chosen}"
    return Route(chosen, rejected, basis)


def route_phases(q: RouteQuery, override: str | None = None,
                 profile: dict | None = None,
                 installed: Callable[[str], bool] = _importable,
                 sparse_decode: bool = False) -> dict[str, Route]:
    """One Route per phase (prefill, decode); raises ValueError with every reason if either
    phase has no valid backend or the override cannot run. sparse_decode (sparse top-k decode is
    configured): decode goes to a backend that can run it, where one can and no override names
    the decode backend; otherwise decode routes densely (the engine warns)."""
    forced = parse_override(override)
    routes = {p: route(dataclasses.replace(q, phase=p), forced.get(p), profile, installed)
              for p in PHASES}
    if sparse_decode and "decode" not in forced:
        try:
            routes["decode"] = route(dataclasses.replace(q, phase="decode", sparse=True), None,
                                     profile, installed)
        except ValueError:
            pass
    return routes


def describe(routes: dict[str, Route]) -> str:
    """Human-readable decision: the chosen backend per phase, then every rejection."""
    lines = []
    for phase, r in routes.items():
        lines.append(f"{phase}: {r.backend} ({r.basis})")
        lines += [f"  {name}: {why}" for name, why in r.rejected.items()]
    return "\n".join(lines)
