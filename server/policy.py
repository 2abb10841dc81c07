"""Per-request KV hints from HTTP: the x-kv-* / x-slo-* headers and vLLM's `kv_transfer_params`
body field, parsed and checked into one engine KVHints (the engine knows no HTTP).

    X-KV-Load-Tiers, X-KV-Store-Tiers   comma list of tier names | all | none
    X-SLO-TTFT-Ms                       time-to-first-token budget, a positive number
    X-SLO-Class                         interactive | batch
    X-Sparse-Attention, X-Speculative   on | off (sparse top-k decode; speculative decoding)
    kv_transfer_params                  {kv_load_tiers, kv_store_tiers: [matcher...],
                                         max_load_tokens, max_offload_tokens}
    matcher                             {"medium": CPU|STORAGE, "locality": LOCAL|REMOTE}; a tier
                                        passes if any matcher matches; a field left out matches
                                        anything; [] allows none

Every bad value is a 400 naming the header or field; a header and a body field that name
different tiers contradict each other and are a 400 too. Nothing is silently ignored."""

from __future__ import annotations

import math
from typing import Any, Mapping

from tierserve.engine.api import KVHints, SloClass, TierDecision, TierDescriptor
from tierserve.server.errors import ApiError, bad_request

_MEDIA, _LOCALITIES = ("CPU", "STORAGE"), ("LOCAL", "REMOTE")
_BODY_KEYS = ("kv_load_tiers", "kv_store_tiers", "max_load_tokens", "max_offload_tokens")
MAX_HINT_TOKENS = (1 << 31) - 1
"""The bound of a token count when no max_model_len is given (a caller without an engine)."""


def parse_hints(headers: Mapping[str, str], body: dict[str, Any] | None,
                tiers: list[TierDescriptor], max_model_len: int = MAX_HINT_TOKENS) -> KVHints:
    """KVHints of one request; raises ApiError (400) naming the bad header or field. Token
    counts (max_load_tokens, max_offload_tokens) are in [0, max_model_len]: a request has no
    more tokens than that to load or store."""
    h = {k.lower(): v for k, v in headers.items()}
    body = _body(body)
    load = _merge("X-KV-Load-Tiers", _header_tiers(h, "x-kv-load-tiers", tiers),
                  "kv_transfer_params.kv_load_tiers", _matched(body, "kv_load_tiers", tiers))
    store = _merge("X-KV-Store-Tiers", _header_tiers(h, "x-kv-store-tiers", tiers),
                   "kv_transfer_params.kv_store_tiers", _matched(body, "kv_store_tiers", tiers))
    return KVHints(load_tiers=load, store_tiers=store, ttft_budget_ms=_budget(h),
                   slo_class=_slo_class(h),
                   max_load_tokens=_count(body, "max_load_tokens", max_model_len),
                   max_offload_tokens=_count(body, "max_offload_tokens", max_model_len),
                   sparse_attention=_on_off(h, "x-sparse-attention"),
                   speculative=_on_off(h, "x-speculative"))


def default_hints(config, tiers: list[TierDescriptor]) -> KVHints:
    """The server's default hints, from its settings (default_kv_load_tiers, ...), built once;
    each field a request does not send keeps its default (KVHints.over). A bad value raises
    ApiError naming the setting."""
    values = {"x-kv-load-tiers": config.default_kv_load_tiers,
              "x-kv-store-tiers": config.default_kv_store_tiers,
              "x-slo-class": config.default_slo_class, "x-slo-ttft-ms": config.default_slo_ttft_ms}
    h = {k: str(v) for k, v in values.items() if v is not None}
    try:
        return KVHints(load_tiers=_header_tiers(h, "x-kv-load-tiers", tiers),
                       store_tiers=_header_tiers(h, "x-kv-store-tiers", tiers),
                       ttft_budget_ms=_budget(h), slo_class=_slo_class(h))
    except ApiError as e:  # name the setting, not the header it stands in for
        setting = "default_" + e.param.lower().removeprefix("x-").replace("-", "_")
        raise ApiError(400, f"{setting}: {e.message.split(': ', 1)[1]}", param=setting) \
            from None


def policy_header(decision: TierDecision) -> str:
    """The X-KV-Policy value: 'load=cpu,disk; store=cpu,disk,s3; s3 skipped: ...'."""
    parts = [f"load={','.join(decision.load_tiers) or 'none'}",
             f"store={','.join(decision.store_tiers) or 'none'}", *decision.notes]
    return "; ".join(parts)


def _body(body: dict[str, Any] | None) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")
    unknown = sorted(set(body) - set(_BODY_KEYS))
    if unknown:
        raise bad_request(f"kv_transfer_params.{unknown[0]} is not supported; supported: "
                          f"{', '.join(_BODY_KEYS)}", f"kv_transfer_params.{unknown[0]}",
                          code="unsupported_parameter")
    return body


def _header_tiers(h: dict[str, str], name: str, tiers: list[TierDescriptor]) -> tuple[str, ...] | None:
    raw = h.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "all":
        return tuple(t.name for t in tiers)
    if value == "none":
        return ()
    names = [n.strip() for n in value.split(",")]
    known = {t.name for t in tiers}
    for n in names:
        if not n:
            raise _header_error(name, f"malformed list {raw!r}: use tier names separated by "
                                "commas, or all, or none")
        if n in ("all", "none"):
            raise _header_error(name, f"{n} cannot be combined with tier names (got {raw!r}): "
                                f"send {n} alone, or only tier names")
        if n not in known:
            raise _header_error(name, f"unknown tier {n!r}; configured: "
                                f"{', '.join(sorted(known)) or 'none'} (or all, none)")
    return tuple(t.name for t in tiers if t.name in names)


def _matched(body: dict[str, Any], key: str, tiers: list[TierDescriptor]) -> tuple[str, ...] | None:
    if key not in body or body[key] is None:
        return None
    param = f"kv_transfer_params.{key}"
    matchers = body[key]
    if not isinstance(matchers, list):
        raise bad_request(f"{param} must be a list of matchers "
                          '({"medium": "CPU"|"STORAGE", "locality": "LOCAL"|"REMOTE"})', param)
    for i, m in enumerate(matchers):
        _check_matcher(m, f"{param}[{i}]")
    return tuple(t.name for t in tiers if any(_matches(m, t) for m in matchers))


def _check_matcher(m: Any, param: str) -> None:
    if not isinstance(m, dict):
        raise bad_request(f"{param} must be an object with medium and/or locality", param)
    for field, allowed in (("medium", _MEDIA), ("locality", _LOCALITIES)):
        if field in m and m[field] not in allowed:
            raise bad_request(f"{param}.{field} must be one of {', '.join(allowed)}, got "
                              f"{m[field]!r}", f"{param}.{field}")
    extra = sorted(set(m) - {"medium", "locality"})
    if extra:
        raise bad_request(f"{param}.{extra[0]} is not a matcher field (medium, locality)",
                          f"{param}.{extra[0]}")


def _matches(m: dict, t: TierDescriptor) -> bool:
    return all(m.get(k, v) == v for k, v in t.matcher().items())


def _merge(hname: str, from_header: tuple[str, ...] | None, bname: str,
           from_body: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if from_header is not None and from_body is not None and set(from_header) != set(from_body):
        raise bad_request(f"{hname} ({','.join(from_header) or 'none'}) and {bname} "
                          f"({','.join(from_body) or 'none'}) name different tiers", bname,
                          code="conflicting_parameters")
    return from_header if from_header is not None else from_body


def _budget(h: dict[str, str]) -> float | None:
    raw = h.get("x-slo-ttft-ms")
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise _header_error("x-slo-ttft-ms", f"must be a number of milliseconds, got {raw!r}") \
            from None
    if not math.isfinite(ms) or ms <= 0:
        raise _header_error("x-slo-ttft-ms", f"must be a positive number of milliseconds, "
                            f"got {raw!r}")
    return ms


def _on_off(h: dict[str, str], name: str) -> bool | None:
    raw = h.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in ("on", "off"):
        raise _header_error(name, f"must be on or off, got {raw!r}")
    return value == "on"


def _slo_class(h: dict[str, str]) -> SloClass | None:
    raw = h.get("x-slo-class")
    if raw is None:
        return None
    try:
        return SloClass(raw.strip().lower())
    except ValueError:
        raise _header_error("x-slo-class", f"must be interactive or batch, got {raw!r}") from None


def _count(body: dict[str, Any], key: str, limit: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    param = f"kv_transfer_params.{key}"
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{param} must be an integer number of tokens, got {v!r}", param,
                          code="invalid_type")
    if not 0 <= v <= limit:
        shown = repr(v) if len(str(v)) <= 20 else f"an integer of {len(str(abs(v)))} digits"
        raise bad_request(f"{param} must be a number of tokens in [0, {limit}], got {shown}",
                          param)
    return v


def _header_error(name: str, message: str) -> ApiError:
    canonical = "-".join(p.upper() if p in ("kv", "slo", "ttft", "x") else p.capitalize()
                         for p in name.split("-"))
    return bad_request(f"header {canonical}: {message}", canonical)


def applied_params(hints: KVHints, load: tuple[str, ...], store: tuple[str, ...],
                   tiers: list[TierDescriptor]) -> dict[str, Any]:
    """The body's kv_transfer_params echoed with what was applied (as vLLM echoes it)."""
    by_name = {t.name: t for t in tiers}
    return {"kv_load_tiers": [by_name[n].matcher() | {"name": n} for n in load if n in by_name],
            "kv_store_tiers": [by_name[n].matcher() | {"name": n} for n in store if n in by_name],
            "max_load_tokens": hints.max_load_tokens,
            "max_offload_tokens": hints.max_offload_tokens}
