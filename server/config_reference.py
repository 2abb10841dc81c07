"""docs/configuration.md, generated from the config dataclasses so it cannot drift from them.

    python -m tierserve.server.config_reference > docs/configuration.md

Each setting's text is its field docstring (the string literal after the field); the flag,
YAML key and environment variable follow from its name. tests/test_docs.py fails when the file
differs from render(). Edit the dataclasses, then regenerate; never edit the output by hand."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap

from tierserve.server import config as server_config
from tierserve.server.config import ENV_PREFIX
from tierserve.server.process_env import PROCESS_ENV

REGENERATE = "python -m tierserve.server.config_reference > docs/configuration.md"

# Per-request hints as a client sends them (server/policy.py parses these into KVHints).
HINT_SOURCES = {
    "load_tiers": "`X-KV-Load-Tiers`, `kv_transfer_params.kv_load_tiers`",
    "store_tiers": "`X-KV-Store-Tiers`, `kv_transfer_params.kv_store_tiers`",
    "ttft_budget_ms": "`X-SLO-TTFT-Ms`",
    "slo_class": "`X-SLO-Class`",
    "max_load_tokens": "`kv_transfer_params.max_load_tokens`",
    "max_offload_tokens": "`kv_transfer_params.max_offload_tokens`",
}

def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of a dataclass, from the string literal after each field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_default(value: object, is_bytes: bool = False) -> str:
    """A default as one would write it in YAML, in backticks; `None` reads as "unset"."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, int) and is_bytes:
        return f"`{_size(value)}`"
    if isinstance(value, (tuple, list)):
        return "`" + ",".join(map(str, value)) + "`" if value else "none"
    return f"`{value}`"


def format_type(annotation: object, is_bytes: bool = False) -> str:
    """The annotation without its `| None` (an unset default says that), or `bytes` for sizes."""
    if is_bytes:
        return "bytes"
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    return "`" + " \\| ".join(parts) + "`"


def _cell(text: str) -> str:
    """Markdown-table-safe text: pipes escaped, and <...> outside code spans shown, not parsed."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def flag_of(name: str, is_bool: bool = False) -> str:
    flag = "--" + name.replace("_", "-")
    return f"`{flag}` / `--no-{flag[2:]}`" if is_bool else f"`{flag}`"


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _server_section() -> str:
    cls = server_config.ServerConfig
    docs, byte_fields = field_docs(cls), set(getattr(server_config, "BYTE_FIELDS", ()))
    rows = []
    for f in dataclasses.fields(cls):
        is_bytes = f.name in byte_fields
        is_bool = isinstance(_default(f), bool) or f.type in ("bool", "bool | None")
        rows.append((f"`{f.name}`", flag_of(f.name, is_bool), f"`{env_of(f.name)}`",
                     format_type(f.type, is_bytes), format_default(_default(f), is_bytes),
                     _cell(docs.get(f.name, ""))))
    config_env = getattr(server_config, "CONFIG_ENV", None)
    file_env = f" or, without it, `{config_env}`" if config_env else ""
    true, false = (getattr(server_config, n, ()) for n in ("_TRUE", "_FALSE"))
    bool_env = (f"; boolean variables take {'/'.join(f'`{v}`' for v in true)} or "
                f"{'/'.join(f'`{v}`' for v in false)}") if true and false else ""
    return "\n\n".join([
        "## Server settings (`tierserve serve`)",
        "Every `ServerConfig` field (server/config.py). A setting comes from, first found: its "
        f"flag, its environment variable, the YAML file named by `--config`{file_env} (a path, "
        "or a shipped preset's name such as `default`), the default below. An empty variable "
        "counts as unset. Byte sizes accept suffixes (`512MiB`, `8GiB`; `8G` and `8GB` also "
        f"mean GiB). Boolean flags have a `--no-` form{bool_env}. `tierserve serve --help` "
        "prints the same list. The model may also come first, as in vLLM: `tierserve serve MODEL` "
        "is `tierserve serve --model MODEL`.",
        _table(("YAML key", "flag", "environment", "type", "default", "meaning"), rows),
    ])


def _nested_section(title: str, cls: type, flat: dict[str, str], server_fields: set[str],
                    intro: str, byte_fields: set[str]) -> str:
    """A config the engine builds from flat settings (`flat`: flat name -> field): server
    settings (flag, YAML key, `LLM(...)` keyword) or `LLM(...)` keywords alone."""
    docs, by_field = field_docs(cls), {v: k for k, v in flat.items()}
    rows = []
    for f in dataclasses.fields(cls):
        name = by_field.get(f.name)
        if name is None:
            setting = "-"
        elif name in server_fields:
            setting = f"`{name}` ({flag_of(name)})"
        else:
            setting = f"`{name}` (`LLM(...)` only)"
        is_bytes = f.name in byte_fields
        rows.append((f"`{f.name}`", setting, format_type(f.type, is_bytes),
                     format_default(_default(f), is_bytes), _cell(docs.get(f.name, ""))))
    header = ("field", "flat setting", "type", "default", "meaning")
    return "\n\n".join([f"## {title}", intro, _table(header, rows)])


def _engine_sections() -> list[str]:
    import tierserve.engine.api as api
    from tierserve.server.config import ServerConfig

    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    tier_args = {"kv_tiers": "tiers", **api.TIER_ARGS}
    sections = [_nested_section(
        "KV tiers (`TierConfig`)", api.TierConfig, tier_args, server_fields,
        "engine/kv_tiers/config.py; see [tiers.md](tiers.md). `tierserve serve` runs cpu,disk "
        "unless `kv_tiers` says otherwise (`none`: off); offline, `LLM(...)` runs none unless "
        "`kv_tiers` names some. The engine builds this from the flat settings in the second column, "
        "which are server settings (configs/tiers.example.yaml sets them all) and `LLM(...)` "
        "keywords. A field with no flat setting keeps its default under `tierserve serve`; "
        "offline, pass a whole `TierConfig` as `LLM(kv_tiers=TierConfig(...))`, and flat "
        "keywords given next to it override its fields.", {"cpu_bytes", "disk_bytes"})]
    sections.append(_nested_section(
        "Sparse decode attention (`SparseConfig`)", api.SparseConfig, api.SPARSE_ARGS,
        server_fields, "engine/config.py. Set through the flat settings in the second column, "
        "or offline as a whole `LLM(sparse=SparseConfig(...))`.", set()))
    return sections


def _hints_section() -> str:
    from tierserve.engine.api import KVHints

    docs = field_docs(KVHints)
    rows = [(f"`{f.name}`", HINT_SOURCES.get(f.name, "see [headers.md](headers.md)"),
             format_type(f.type), format_default(_default(f)), _cell(docs.get(f.name, "")))
            for f in dataclasses.fields(KVHints)]
    return "\n\n".join([
        "## Per-request KV hints (`KVHints`)",
        "engine/core/kv_hints.py. Not server settings: each request sends its own, as headers or "
        "vLLM's `kv_transfer_params` body field ([headers.md](headers.md)); offline, "
        "`LLM.generate(..., kv_hints=KVHints(...))`. A field left unset falls back to the "
        "server's `default_*` settings above, then to the scheduler's cost model.",
        _table(("field", "HTTP", "type", "default", "meaning"), rows),
    ])


def _env_section() -> str:
    rows = [(f"`{name}`", _cell(text)) for name, text in PROCESS_ENV.items()]
    return "\n\n".join([
        "## Process environment",
        "Read by the process itself, outside the settings above.",
        _table(("variable", "meaning"), rows),
    ])


def render() -> str:
    """The whole of docs/configuration.md."""
    head = "\n\n".join([
        "# Configuration reference",
        f"<!-- Generated by `{REGENERATE}` from the config dataclasses' field docstrings. "
        "Do not edit by hand: change the dataclass, then regenerate. -->",
        "Examples of whole files: [configs/default.yaml](../configs/default.yaml) and "
        "[configs/tiers.example.yaml](../configs/tiers.example.yaml). A YAML key may use `-` or "
        "`_`. Every value is checked against its type below before the model loads: an unknown "
        "key, a value of the wrong type or a YAML syntax error stops start-up with one line "
        "naming the file, the line and the key (`c.yaml:2: max_num_seqs: expected an integer, "
        "got 'lots'`; `c.yaml:1: unknown setting 'max_num_seq'; did you mean 'max_num_seqs'?`), "
        "as a bad flag or variable does ([troubleshooting.md](troubleshooting.md#settings-"
        "rejected)).",
    ])
    parts = [head, _server_section(), *_engine_sections(), _hints_section(), _env_section()]
    return "\n\n".join(parts) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
