"""The joints between the rooms, checked on the source: the server reads the engine only through
its request API and its published EngineInfo; the request carries no tier state (the KV
connector's table does). The torch-free imports are checked in test_block_pool.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tierserve.engine.core.request import Request

ROOT = Path(__file__).resolve().parent.parent
INTERNALS = re.compile(r"\.engine\.engine\b|\bengine\.engine\.|\.runner\b|\.tier_io\b|"
                       r"\.scheduler\b|\.kv_worker\b|\.pool\b")


def test_no_server_module_reads_engine_internals():
    found = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if not code.lstrip().startswith(("from ", "import ")) and INTERNALS.search(code):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_request_carries_no_tier_state():
    names = [f.name for f in dataclasses.fields(Request)]
    assert not [n for n in names if "tier" in n or "stored" in n], names
