"""`tierserve <subcommand>`: serve (the HTTP server) and generate (one offline completion).

One small function per subcommand; a teammate adds `route` and `bench-backends` the same way."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before anything imports torch

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import typing  # noqa: E402

from server.config import FIELDS, ServerConfig, load_config  # noqa: E402


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One --flag per ServerConfig field; a flag left out keeps the YAML (or default) value."""
    hints = typing.get_type_hints(ServerConfig)
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = hints[name]
        doc = _field_doc(name)
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        conv = str if name == "kv_cache_memory_bytes" else base
        p.add_argument(flag, type=conv, default=None, help=f"{doc} (default: {f.default})")


def _field_doc(name: str) -> str:
    import ast
    import inspect
    src = inspect.getsource(ServerConfig)
    tree = ast.parse(src).body[0]
    body = tree.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                return str(nxt.value.value).replace("%", "%%")
    return ""


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in FIELDS}
    try:
        config = load_config(args.config, overrides)
    except (OSError, ValueError, TypeError) as e:
        print(f"tierserve serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.llm import build_config
    from engine.llm_engine import LLMEngine
    from server.app import build_app

    engine = AsyncEngine(LLMEngine(build_config(**config.engine_kwargs())), config.max_queue)
    engine.start()
    app = build_app(config, engine)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.log_level.lower(),
                               timeout_graceful_shutdown=int(config.drain_timeout_s))
    server = _draining_server(uv_config, engine)
    server.run()
    engine.stop()
    return 0


def _draining_server(config, engine):
    """A uvicorn.Server that stops admitting on SIGTERM, lets in-flight work finish (up to
    drain_timeout_s), and then exits 0 instead of re-raising the signal."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals
                                          if s != signal.SIGTERM]

    return DrainingServer(config)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.generate([args.text], params)[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--config", default=None, help="YAML settings file (e.g. configs/default.yaml)")
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="print one completion of TEXT (offline engine)")
    gen.add_argument("text")
    gen.add_argument("--model", default=ServerConfig.model)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
