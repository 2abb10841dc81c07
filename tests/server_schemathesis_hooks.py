"""Schemathesis hooks (SCHEMATHESIS_HOOKS=server_schemathesis_hooks) for the bounded fuzz run.

Most generated bodies get the served model's name, so they reach validation and the engine
instead of stopping at 404; valid output lengths are cut to a few tokens to keep the run short."""

from __future__ import annotations

import schemathesis

MODEL = "smollm2-135m"
_SHORT = 4


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    if "model" in body and len(repr(body)) % 7:  # 6 in 7 bodies name the real model
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and _SHORT < v <= 64:
            body[key] = _SHORT
    if "messages" in body and body.get("max_tokens") is None and \
            body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = _SHORT
    return body
