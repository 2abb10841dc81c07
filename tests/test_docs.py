"""The user docs against the real thing: the configuration reference against the dataclasses, the
curl examples against a running server (with the real `curl`), and the metrics page and Grafana
dashboard against what /metrics exports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from server_fixtures import MODEL, ROOT, RunningServer, run_server
from tierserve.server import config_reference
from tierserve.server.config import ServerConfig
from tierserve.server.process_env import PROCESS_ENV

DOCS = ROOT / "docs"
CURL_DOCS = ("quickstart.md", "headers.md")
"""Pages whose ```bash / ```sh curl commands must run against a server as written."""
DOC_PORT = re.compile(r"(?:https?://)?(?:localhost|127\.0\.0\.1):8000")
MAX_EXAMPLE_TOKENS = 32
"""Examples that generate must ask for at most this many tokens, so the test takes seconds."""
PACKAGE_DIRS = ("server", "engine", "kernels", "tierserve")


# ---- configuration reference ---------------------------------------------------------------

def test_config_reference_current():
    """docs/configuration.md is exactly what the generator makes of today's dataclasses."""
    path = DOCS / "configuration.md"
    current = path.read_text() if path.exists() else ""
    assert current == config_reference.render(), (
        f"docs/configuration.md is out of date with the config dataclasses; regenerate it with\n"
        f"    {config_reference.REGENERATE}")


def test_config_reference_flags_are_real():
    """Every flag the reference names for a server setting is one `tierserve serve` accepts, and
    every ServerConfig field has its row (YAML key, flag, environment variable)."""
    from tierserve.server.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    accepted = {opt for action in serve._actions for opt in action.option_strings}
    text = config_reference.render()
    flags = set(re.findall(r"`(--[a-z0-9]+(?:-[a-z0-9]+)*)`", text))
    assert flags and flags <= accepted, f"flags not accepted by serve: {sorted(flags - accepted)}"
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `")}
    for name in (f.name for f in dataclasses.fields(ServerConfig)):
        assert f"`{name}`" in rows, name
        assert f"`--{name.replace('_', '-')}`" in text and f"`TIERSERVE_{name.upper()}`" in text


def test_every_environment_variable_documented():
    """Each TIERSERVE_* name the code reads is in the reference (a setting's variable, the config
    file's, or the process table), and each process variable documented is still read."""
    used = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name not in ("config_reference.py", "process_env.py"):
                used |= set(re.findall(r"\bTIERSERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    text = config_reference.render()
    undocumented = {n for n in used if f"`{n}`" not in text}
    assert not undocumented, f"add to server/process_env.py: {sorted(undocumented)}"
    stale = {n for n in PROCESS_ENV if n.startswith("TIERSERVE_")} - used
    assert not stale, f"no longer read by the code: {sorted(stale)}"


# ---- one server for the examples and the metrics ---------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    """The embedded model with the cpu and disk tiers, so tier headers and metrics are live."""
    tmp = tmp_path_factory.mktemp("docs")
    with run_server(tmp, "--kv-tiers", "cpu,disk", "--disk-tier-dir", str(tmp / "kv"),
                    "--cpu-tier-bytes", "64MiB", "--max-num-seqs", "8") as s:
        yield s


def _fenced_curl_commands(text: str) -> list[str]:
    """Each curl command of the page's ```bash / ```sh blocks: backslash continuations joined, and
    a quoted argument (a JSON body) may span lines, as in the shell."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line.strip()
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if pending.startswith("curl "):
                commands.append(pending)
            pending = ""
        assert not pending, f"unclosed quote in a docs example: {pending}"
    return commands


EXAMPLES = [(doc, cmd) for doc in CURL_DOCS if (DOCS / doc).exists()
            for cmd in _fenced_curl_commands((DOCS / doc).read_text())]


def _run_curl(cmd: str, base_url: str) -> tuple[list[str], int, str]:
    """The command's arguments (pointed at the test server), its HTTP status and its stdout with
    any response headers (-D -) removed."""
    curl = shutil.which("curl")
    assert curl, "the docs tests run the examples with the real `curl`; install curl"
    args = shlex.split(DOC_PORT.sub(base_url, cmd), comments=True)
    assert not {"|", "||", "&&", ";", ">"} & set(args), f"keep curl examples one command: {cmd}"
    proc = subprocess.run([curl, *args[1:], "-sS", "--max-time", "120", "-w", "\n%{http_code}"],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"curl failed ({proc.returncode}): {proc.stderr}\n{cmd}"
    body, _, status = proc.stdout.rpartition("\n")
    while body.startswith("HTTP/"):  # -D - and -i print the headers first (text mode: \n)
        body = body.split("\n\n", 1)[1]
    return args, int(status), body


def _request_json(args: list[str]) -> dict | None:
    for flag, value in zip(args, args[1:]):
        if flag in ("-d", "--data", "--data-raw", "--json"):
            return json.loads(value)
    return None


def _check_generation(path: str, data: dict, body: str) -> None:
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    assert limit is not None and limit <= MAX_EXAMPLE_TOKENS, (
        f"give generating examples \"max_tokens\" <= {MAX_EXAMPLE_TOKENS}: {data}")
    key = "message" if path.endswith("/chat/completions") else "text"
    if data.get("stream"):
        events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all("error" not in c for c in chunks), body
        assert any(c["choices"] for c in chunks), body
        return
    out = json.loads(body)
    assert out["choices"] and out["usage"]["completion_tokens"] >= 1, out
    choice = out["choices"][0]
    assert isinstance(choice[key]["content"] if key == "message" else choice[key], str), out


@pytest.mark.parametrize("doc,cmd", EXAMPLES,
                         ids=[f"{d}:{i}" for i, (d, _) in enumerate(EXAMPLES)])
def test_quickstart_curl_examples(server, doc, cmd):
    """Each documented curl command, run as written against a real server: a 2xx and a body of
    the documented shape (JSON with choices, or SSE ending in `data: [DONE]`)."""
    args, status, body = _run_curl(cmd, server.base_url)
    assert 200 <= status < 300, f"{doc}: HTTP {status} for\n{cmd}\n{body}"
    url = next(a for a in args[1:] if a.startswith(server.base_url))
    path = url[len(server.base_url):].split("?")[0]
    if path.endswith("completions"):
        _check_generation(path, _request_json(args) or {}, body)
    elif path == "/v1/models":
        assert MODEL in [m["id"] for m in json.loads(body)["data"]], body
    elif path == "/metrics":
        assert "vllm:num_requests_running" in body
    elif path == "/health":
        assert body == ""


def test_quickstart_covers_the_api():
    """The quickstart keeps one example for each endpoint and feature it promises."""
    text = (DOCS / "quickstart.md").read_text()
    commands = _fenced_curl_commands(text)
    joined = "\n".join(commands)
    for needle in ("/v1/completions", "/v1/chat/completions", '"stream": true', "curl -N",
                   "X-KV-Load-Tiers", "X-KV-Store-Tiers", "X-SLO-Class", "X-SLO-TTFT-Ms",
                   "/v1/models", "/health", "/metrics"):
        assert needle in joined, f"docs/quickstart.md lost its curl example with {needle}"
    readme_commands = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()
                       if ln.startswith("    make ")]
    assert len(readme_commands) == 2, "README.md lost its two commands (make serve, make test)"
    for needle in (*readme_commands, "docker run --gpus all", "(docker.md)"):
        assert needle in text, f"docs/quickstart.md lacks {needle!r}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_doc_links_resolve():
    """Every relative link in README.md and docs/*.md names a file that exists (and a heading
    that exists, where it names one)."""
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target) if target else page
            if not path.exists() or (anchor and path.suffix == ".md"
                                     and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---- metrics page and Grafana dashboard ------------------------------------------------------

def _exported(server: RunningServer) -> tuple[set[str], set[str]]:
    """(every series name a query may use, every metric family) of the server's /metrics. A family
    with no series yet (no error so far) still counts: its # TYPE line declares it."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    names, families = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if name.endswith("_created"):
                continue
            families.add(name)
            names.add(name)
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names, families


@pytest.fixture(scope="module")
def exported(server) -> tuple[set[str], set[str]]:
    """/metrics after one completion and one error, so request and error series exist."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    assert httpx.post(server.v1 + "/completions", json=body, timeout=120).status_code == 200
    assert httpx.post(server.v1 + "/completions", json={**body, "model": "nope"},
                      timeout=30).status_code == 404
    return _exported(server)


def _walk_panels(panels: list[dict]):
    for p in panels:
        yield p
        yield from _walk_panels(p.get("panels", []))


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers with a colon, outside strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors such as [$__rate_interval]
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*", expr))


def test_grafana_metrics_exist(exported):
    """The dashboard is valid Grafana JSON (datasource variable, panels with targets), and every
    metric its queries use is exported by a real server."""
    dash = json.loads((DOCS / "grafana" / "tierserve.json").read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = [n for n, v in variables.items() if v["type"] == "datasource"]
    assert ds and variables[ds[0]]["query"] == "prometheus", "no prometheus datasource variable"
    names, _ = exported
    used: set[str] = set()
    panels = [p for p in _walk_panels(dash["panels"]) if p["type"] != "row"]
    assert len(panels) >= 12
    for p in panels:
        assert p["title"] and set(p["gridPos"]) >= {"x", "y", "w", "h"}, p.get("title")
        assert p["datasource"]["uid"] == "${%s}" % ds[0], p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and 'model_name="$model_name"' in t["expr"], (p["title"], t)
            used |= _metric_names(t["expr"])
    for v in variables.values():
        q = v.get("query")
        used |= _metric_names(q if isinstance(q, str) else (q or {}).get("query", ""))
    assert not used - names, f"dashboard queries metrics /metrics does not have: {used - names}"
    for family in ("vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc",
                   "tierserve:kv_tier_breaker_state", "tierserve:kv_policy_decisions_total"):
        assert any(u.startswith(family) for u in used), f"no panel over {family}"


def test_metrics_doc_lists_every_metric(exported):
    """docs/metrics.md names every metric family /metrics exports, and nothing it does not."""
    _, families = exported
    text = (DOCS / "metrics.md").read_text()
    missing = {f for f in families if f"`{f}`" not in text}
    assert not missing, f"docs/metrics.md lacks {sorted(missing)}"
    documented = set(re.findall(r"`((?:vllm|tierserve):[a-z0-9_:]+)`", text))
    names, _ = exported
    assert not documented - names, f"docs/metrics.md names unknown metrics {documented - names}"
