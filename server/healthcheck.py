"""The container's health probe: GET /health on the local server, with an API key when one is set.

    python3 -m tierserve.server.healthcheck    # exit 0 when the server answers 200, else 1

The port is TIERSERVE_PORT (default 8000); with TIERSERVE_SSL_CERTFILE set the server speaks
HTTPS and so does the probe (to 127.0.0.1, whatever names the certificate holds: it is not
verified, the probe only asks whether this container's server answers). Started with
--auth-health-metrics, the server asks for a key on /health too: the probe sends the first key of
TIERSERVE_API_KEY, or of the file named by TIERSERVE_API_KEY_FILE, the variables the server itself
reads (a key given only as a flag is not visible here: override the healthcheck then). It imports
no torch: it runs every 30 seconds."""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request
from typing import Mapping

from tierserve.server.config import ENV_PREFIX, read_key_file, split_keys


def probe_key(environ: Mapping[str, str]) -> str | None:
    keys = split_keys(environ.get(ENV_PREFIX + "API_KEY"))
    key_file = environ.get(ENV_PREFIX + "API_KEY_FILE")
    if not keys and key_file:
        keys = read_key_file(key_file)
    return keys[0] if keys else None


def main(environ: Mapping[str, str] = os.environ) -> int:
    port = environ.get(ENV_PREFIX + "PORT") or "8000"
    tls = bool(environ.get(ENV_PREFIX + "SSL_CERTFILE"))
    req = urllib.request.Request(f"{'https' if tls else 'http'}://127.0.0.1:{port}/health")
    context = ssl._create_unverified_context() if tls else None  # loopback liveness only
    key = probe_key(environ)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=4, context=context) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:  # refused, 401, 503, timeout
        print(f"health check failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
