"""Who is calling: the API key a request sent, known only by its digest, and whether it is an
operator's (admin) key.

    keys configured          generation routes         operator routes (/v1/kv/events)
    ---------------          -----------------         -------------------------------
    none                     open                      open (one trusted tenant)
    api_key only             a key (401 without)       403 for every key: no operator
    admin_api_key only       open                      the admin key (401 without)
    both                     a key (either kind)       the admin key; an api key gets 403

The key itself is never kept past the comparison: the gate stores the caller's SHA-256 digest,
from which the per-key cache scope is derived (server/serving.py)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from tierserve.server.errors import ApiError


@dataclass(frozen=True)
class Caller:
    """A request's verified key."""

    key_digest: bytes
    """SHA-256 of the key (never the key)."""
    admin: bool
    """An admin_api_key: may read the routes that see across tenants."""

    @property
    def tenant(self) -> str:
        """The key's name for its share of the engine (fair share) and per-tenant metrics: 12 hex
        digits of a digest of the key's digest, as the cache scope is derived (never the key, nor
        the value keys are compared by)."""
        return hashlib.sha256(b"tierserve tenant|" + self.key_digest).hexdigest()[:12]


class KeyRing:
    def __init__(self, api_keys: tuple[str, ...], admin_keys: tuple[str, ...]):
        self._keys = [(digest(k.encode()), False) for k in api_keys] + \
            [(digest(k.encode()), True) for k in admin_keys]
        self.required = bool(api_keys)
        """Every route but the probes needs a key."""
        self.has_admin = bool(admin_keys)

    @property
    def open(self) -> bool:
        """No key of any kind is configured."""
        return not self._keys

    def identify(self, authorization: str) -> Caller | None:
        """The caller of an `Authorization: Bearer <key>` header, or None for a missing, malformed
        or unknown key. Compared as SHA-256 digests (equal length, so neither the key's length
        nor a common prefix shows in the time), against every key without stopping at a match."""
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        sent = digest(token.strip().encode("latin-1"))  # the header's bytes as they came
        found = None
        for key, admin in self._keys:
            if hmac.compare_digest(sent, key):
                found = Caller(key, admin)
        return found


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def caller(request: Request) -> Caller | None:
    """The verified key of this request (None: none sent, or no keys configured)."""
    return request.scope.get("state", {}).get("caller")


def tenant_of(request: Request) -> str | None:
    """Whose share of the engine this request uses: its key's tenant; None without a key (a
    server without keys is one tenant)."""
    who = caller(request)
    return None if who is None else who.tenant


def require_operator(request: Request) -> None:
    """A route that sees across tenants: the admin key, unless the server has no keys at all."""
    ring: KeyRing = request.app.state.keys
    if ring.open:
        return
    who = caller(request)
    if who is None:
        raise ApiError(401, "this route needs the admin key: send 'Authorization: Bearer "
                            "<admin key>'.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not who.admin:
        how = "" if ring.has_admin else " (none is configured: start the server with " \
                                        "--admin-api-key)"
        raise ApiError(403, f"{request.url.path} shows every tenant's KV cache activity: it "
                            f"needs an admin key{how}", type_="permission_error",
                       code="admin_key_required")
