"""The joints between the rooms, checked on the source. The server reads the engine only through
its request API and its published EngineInfo; the request carries no tier state (the KV
connector's table does). The code's layers, read from its imports with ast (every import: module
level, inside functions, under TYPE_CHECKING): no two files import each other through any chain,
the engine's folders form no loop, and nothing imports upward (a folder of the engine into the
engine's loop, the engine into the server). The torch-free imports are checked in
test_block_pool.py."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from pathlib import Path

from tierserve.engine.core.request import Request

ROOT = Path(__file__).resolve().parent.parent
INTERNALS = re.compile(r"\.engine\.engine\b|\bengine\.engine\.|\.runner\b|\.executor\b|"
                       r"\.tier_io\b|\.scheduler\b|\.kv_worker\b|\.pool\b")

PACKAGES = ("engine", "server", "kernels")
TOP = "tierserve"
ENGINE_LOOP = {"engine.llm_engine", "engine.async_engine", "engine.llm"}
"""The engine's top: what runs the loop. Its folders (core, worker, kv_tiers, spec) sit below it
and may read the engine's value modules (config, sampling_params, outputs ...), never these."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a name imported from a package resolves to the
    submodule when there is one)."""
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}

    def resolve(name: str) -> str | None:
        name = name.removeprefix(TOP + ".")
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([TOP, *up, *([base] if base else [])])
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                if n.startswith(TOP + "."):
                    target = resolve(n)
                    if target and target != mod:
                        edges[mod].add(target)
        edges.setdefault(mod, set())
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _folder(mod: str, edges) -> str:
    return mod if any(m.startswith(mod + ".") for m in edges) else mod.rpartition(".")[0]


def test_no_two_files_import_each_other():
    loops = _cycles(_graph())
    assert not loops, f"import loops (each a group of files reaching each other): {loops}"


def test_the_engines_folders_form_no_loop():
    edges = _graph()
    folders: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for a, targets in edges.items():
        fa = _folder(a, edges)
        if not fa.startswith("engine."):
            continue
        for b in targets:
            fb = _folder(b, edges)
            if fb != fa and fb.startswith("engine."):
                folders[fa].add(fb)
                why.setdefault((fa, fb), f"{a} -> {b}")
    loops = _cycles(folders)
    assert not loops, "folder loops: " + "; ".join(
        ", ".join(why.get((x, y), "") for x in g for y in g if (x, y) in why) for g in loops)


def test_nothing_imports_upward():
    edges = _graph()
    upward = []
    for a, targets in edges.items():
        for b in targets:
            if a.startswith(("engine.", "kernels.")) and b.startswith("server."):
                upward.append(f"{a} -> {b} (the engine and kernels never import the server)")
            below = a.count(".") >= 2 and a.startswith("engine.") and not a.startswith("engine.eval")
            if below and b in ENGINE_LOOP:
                upward.append(f"{a} -> {b} (a folder of the engine imports the engine's loop)")
            if a.startswith("kernels.") and b.startswith("engine.") and b.count(".") >= 2:
                upward.append(f"{a} -> {b} (kernels sit below the engine's folders)")
    assert not upward, "\n".join(sorted(upward))


def test_the_checks_see_a_loop_and_an_upward_import():
    """The graph reads this tree's imports (the engine's runner imports its models), and the
    cycle finder reports a planted loop: the checks above can fail."""
    edges = _graph()
    assert "engine.worker.models" in edges["engine.worker.model_runner"] or \
        "engine.worker.models.llama" in edges["engine.worker.model_runner"]
    planted = {k: set(v) for k, v in edges.items()}
    planted["engine.worker.models.llama"].add("engine.worker.model_runner")
    assert any("engine.worker.model_runner" in g for g in _cycles(planted))


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


def test_the_engine_loop_stays_small_and_never_asks_which_executor():
    """llm_engine.py keeps add / step / abort / outputs (construction is engine/build.py's)
    under 300 lines, with no isinstance on an executor or a runner; no function in the library
    runs past 60 lines."""
    loop = (ROOT / "engine" / "llm_engine.py").read_text()
    assert len(loop.splitlines()) < 300
    asks = [n for n in ast.walk(ast.parse(loop)) if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) == "isinstance"
            and re.search(r"Executor|Runner", ast.unparse(n))]
    assert not asks, [ast.unparse(n) for n in asks]
    long = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, long


def test_the_server_imports_the_engine_only_through_its_face():
    """server/ names the engine only as `tierserve.engine.api` (its value types, errors and
    operations): no route, metric or CLI path reaches into an engine module."""
    outside = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.startswith("tierserve.engine") and n != "tierserve.engine.api"]
    assert not outside, outside
