"""`tierserve <subcommand>`: serve (the HTTP server) and generate (one offline completion).

One small function per subcommand; a teammate adds `route` and `bench-backends` the same way."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before anything imports torch

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import difflib  # noqa: E402
import errno  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import ssl  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import typing  # noqa: E402
from urllib.parse import unquote  # noqa: E402

from tierserve.server.config import (ENV_PREFIX, FIELDS, LOG_LEVELS, ServerConfig,  # noqa: E402
                                     env_typos, load_config, read_chat_template, split_keys,
                                     typed)

log = logging.getLogger("tierserve.server.cli")

COMMANDS = {
    "serve": "run the OpenAI-compatible HTTP server",
    "generate": "print one completion of TEXT (offline engine)",
    "route": "print the attention backend decision for a device and shape",
    "bench-backends": "time every valid attention backend for a shape on this machine and write "
                      "the profile the router prefers",
}
"""Each subcommand's one-line help: `tierserve --help`, and `tierserve` alone, list them."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
"""Variables whose values never reach a log line, with the API keys (configured or in
TIERSERVE_API_KEY)."""


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One --flag per ServerConfig field; a flag left out keeps the YAML (or default) value."""
    hints, docs = typing.get_type_hints(ServerConfig), _field_docs()
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = hints[name]
        doc = docs.get(name, "")
        if bool in (kind, *typing.get_args(kind)):  # bool, or bool | None (unset: a default)
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc)
            continue
        if typing.get_origin(kind) is tuple:  # repeatable, each may be a comma list
            p.add_argument(flag, action="append", default=None,
                           metavar="KEY" if name.endswith("api_key") else "VALUE", help=doc)
            continue
        p.add_argument(flag, type=_flag_type(name), default=None, metavar=name.upper(),
                       help=f"{doc} (default: {f.default})")


def _flag_type(name: str) -> typing.Callable[[str], typing.Any]:
    """A flag's value checked and typed as the YAML key's and the variable's are: argparse then
    says `argument --max-num-seqs: expected an integer, got 'lots'`."""
    def convert(text: str) -> typing.Any:
        try:
            return typed(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name}: ")) from None
    return convert


def _field_docs() -> dict[str, str]:
    from tierserve.server.config_reference import field_docs
    return {k: v.replace("%", "%%") for k, v in field_docs(ServerConfig).items()}


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives threads that allocate their own malloc arenas; with the tier pools' threads
    moving 0.7 MB blocks, a 10-minute soak (bench/soak.py) grew RSS ~227 MiB/h, and
    MALLOC_ARENA_MAX=2 kept it flat. An explicit MALLOC_ARENA_MAX wins; off glibc, nothing."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class _Refused(Exception):
    """A start-up error: one line on stderr (`tierserve serve: ...`) and this exit status, no
    traceback, and before the model loads wherever the check can run that early."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except _Refused as e:
        print(f"tierserve serve: {e}", file=sys.stderr)
        return e.status


def _serve(args: argparse.Namespace) -> int:
    """Cheap checks first (settings, the port, certificates, the chat template), each in a
    second; then the model loads (minutes, the first time, with the native build)."""
    config = _settings(args)
    held = reserve_port(config.host, config.port)  # before logging: an error stays one line
    try:
        setup_logging(config.log_level)
        for typo in env_typos(os.environ):
            log.warning("%s", typo)
        _limit_malloc_arenas()
        secrets = _secrets(config)
        redact_log_output(secrets)
        log.info("settings: %s", config.describe())
        _check_files(config)
        engine, app = _build(config)
    finally:
        for sock in held:  # uvicorn binds the port itself, a moment from now
            sock.close()
    return _run(config, engine, app, secrets)


def _settings(args: argparse.Namespace) -> ServerConfig:
    """Defaults < YAML < TIERSERVE_* < flags, every value typed; MODEL may also come
    positionally (`tierserve serve MODEL`, as `vllm serve MODEL`)."""
    flags = {k: getattr(args, k) for k in FIELDS}
    if args.model_arg is not None:
        if flags["model"] not in (None, args.model_arg):
            raise _Refused(f"two models given: {args.model_arg!r} and --model "
                           f"{flags['model']!r}; give one")
        flags["model"] = args.model_arg
    try:
        return load_config(args.config, flags)
    except (OSError, ValueError, TypeError) as e:
        raise _Refused(str(e)) from None


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Bind, without listening, each address uvicorn will listen on, so a port in use stops
    start-up at once instead of after the model has loaded (uvicorn binds only then). The
    caller closes them just before uvicorn binds."""
    held: list[socket.socket] = []
    try:
        for info in set(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)):
            sock = _bind(*info)
            if sock is not None:
                held.append(sock)
        if not held:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
    except OSError as e:
        for sock in held:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise _Refused(f"port {port} on {host} is in use; use --port") from None
        raise _Refused(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return held


def _bind(family, kind, proto, _name, addr) -> socket.socket | None:
    """One address bound as asyncio's create_server binds it: SO_REUSEADDR (a port in
    TIME_WAIT from the last run is free), IPV6_V6ONLY, and an address family the host has
    not enabled (EADDRNOTAVAIL: ::1 without IPv6) skipped."""
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    return sock


def setup_logging(level: str) -> None:
    """The start-up lines (settings, the native build, the attention backend, KV blocks) on
    stderr, alike for serve and generate."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def _check_files(config: ServerConfig) -> None:
    """The model's file, the certificate and the chat template, before the model loads (and
    before torch is imported): a typo fails in a second."""
    from tierserve.engine.api import resolve_path

    resolve_path(config.model)  # a ModelLoadError: main's one line
    if config.ssl_certfile is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.ssl_certfile,
                                                                    config.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise _Refused(f"ssl_certfile/ssl_keyfile: {e}") from None
    if config.chat_template is not None:
        from tierserve.engine.api import compile_chat_template

        try:
            compile_chat_template(read_chat_template(config.chat_template))
        except (OSError, ValueError) as e:
            raise _Refused(f"chat_template: {e}") from None


def _build(config: ServerConfig):
    """The engine (the model loads here) and the app over it."""
    from tierserve.engine.api import DeviceError, ModelLoadError, WorkerDied, open_engine
    from tierserve.server.app import build_app
    from tierserve.server.errors import ApiError

    try:
        engine = open_engine(config.engine_kwargs(), config.max_queue)
    except (DeviceError, ModelLoadError):
        raise  # main() prints them
    except ValueError as e:  # a setting out of range, or one the model cannot take (tensor
        raise _Refused(str(e)) from None  # parallel, a draft model)
    except WorkerDied as e:  # a tensor-parallel rank could not start: its error
        raise _Refused(str(e), status=1) from None
    try:
        return engine, build_app(config, engine)
    except ApiError as e:  # a bad default_* hint: the same check a request's header gets
        engine.stop()
        raise _Refused(e.message) from None


def _run(config: ServerConfig, engine, app, secrets: list[str]) -> int:
    """Serve until SIGTERM (a drain) or until the engine dies (exit 1)."""
    import uvicorn

    from tierserve.server.transport import limited_h11

    engine.start()
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.log_level.lower(),
                               http=limited_h11(config.header_timeout_s, config.max_header_bytes),
                               timeout_graceful_shutdown=config.drain_timeout_s,
                               ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)
    redact_log_output(secrets)  # uvicorn.Config set up its own handlers
    server = _draining_server(uv_config, engine, app.state.ctx.open_groups)
    watch = threading.Thread(target=_exit_when_engine_dies, args=(engine, server), daemon=True)
    watch.start()
    server.run()
    engine.stop()
    if engine.fatal:
        print("tierserve serve: the engine stopped after an error (see the log above); exiting",
              file=sys.stderr)
        return 1
    return 0


def _exit_when_engine_dies(engine, server, every_s: float = 0.2, grace_s: float = 1.0) -> None:
    """A dead engine (a tensor-parallel rank lost, the loop failed) ends the server within a few
    seconds: every request has its error already; /health answers 503 for grace_s (a probe or a
    balancer sees it), then the server stops and the process exits non-zero."""
    while not server.should_exit:
        if engine.fatal:
            log.critical("the engine stopped after an error: shutting down in %g s", grace_s)
            time.sleep(grace_s)
            server.should_exit = True
            return
        time.sleep(every_s)


def _secrets(config: ServerConfig) -> list[str]:
    """The API and admin keys (configured, or in TIERSERVE_API_KEY / TIERSERVE_ADMIN_API_KEY though
    a flag won) and the values of SECRET_ENV."""
    found = list(config.api_key) + list(config.admin_api_key)
    for var in ("API_KEY", "ADMIN_API_KEY"):  # also when a flag won over the variable
        found += split_keys(os.environ.get(ENV_PREFIX + var))
    found += [os.environ.get(var, "") for var in SECRET_ENV]
    return [s for s in found if s]


class _Redacting(logging.Formatter):
    """A handler's own formatter, then every secret in the finished text masked: message,
    arguments (uvicorn's access log formats the request line from them) and traceback alike.
    The access log writes the URL as sent, so a key may also come percent-encoded
    (`?api_key=k%2Dalpha`, `%2d`, `%252D` encoded twice, `+` for a space): when a decoding of
    the line holds a secret, the line is written so decoded, with the secret masked."""

    def __init__(self, inner: logging.Formatter | None, secrets: list[str]):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.secrets = sorted(set(secrets), key=len, reverse=True)  # a key inside a longer one

    def format(self, record: logging.LogRecord) -> str:
        text = probe = self._mask(self.inner.format(record))
        for _ in range(3):  # each round peels one layer of encoding
            if "%" not in probe and "+" not in probe:
                break
            probe = unquote(probe)
            for decoded in (probe, probe.replace("+", " ")):
                if self._mask(decoded) != decoded:
                    text = probe = self._mask(decoded)
        return text

    def _mask(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text


def redact_log_output(secrets: list[str]) -> None:
    """Wrap the formatter of every handler configured now (root's, uvicorn's) in _Redacting."""
    if not secrets:
        return
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not isinstance(handler.formatter, _Redacting):
            handler.setFormatter(_Redacting(handler.formatter, secrets))


def _draining_server(config, engine, open_groups):
    """A uvicorn.Server that stops admitting on SIGTERM, lets in-flight work finish (up to
    drain_timeout_s; streams still open just before then end with a shutting_down error event
    and [DONE]), and then exits 0 instead of re-raising the signal."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals
                                          if s != signal.SIGTERM]

        async def _wait_tasks_to_complete(self) -> None:
            # uvicorn runs this under asyncio.timeout(drain time), then cancels what is left
            loop, drain_s = asyncio.get_running_loop(), self.config.timeout_graceful_shutdown
            helpers = [loop.create_task(_abort_lingering_closes(self.server_state.connections)),
                       loop.create_task(_end_in_time(drain_s, open_groups))]
            try:
                await super()._wait_tasks_to_complete()
            finally:
                for task in helpers:
                    task.cancel()

    return DrainingServer(config)


async def _end_in_time(drain_s: float | None, open_groups, margin_s: float = 1.0) -> None:
    """At the drain timeout uvicorn cancels each request's task: a stream would stop with a bare
    close (no error event, no [DONE]), a collected answer with a plain-text 500, and the log would
    get their tracebacks. So groups still open `margin_s` before then (a quarter of a short drain
    time) end themselves: an error event and [DONE], or a 503; their blocks freed."""
    if drain_s is None:
        return
    await asyncio.sleep(drain_s - min(margin_s, drain_s / 4))
    ended = open_groups.end_all(f"the server is shutting down: drain_timeout_s ({drain_s:g} s) "
                                 "ran out before this request finished")
    if ended:
        log.warning("drain time is up: %d open request(s) ended with a shutting_down error", ended)


async def _abort_lingering_closes(connections, grace_s: float = 1.0) -> None:
    """Shutdown closes idle keep-alive connections (and each busy one once its response is out).
    Over TLS a close waits for the client's close_notify, which an idle pooled client never
    sends, so every such connection held the exit for asyncio's 30 s SSL shutdown timeout. A
    connection still closing `grace_s` after it began is aborted; one with a response in flight
    is not closing and drains as before."""
    loop, since = asyncio.get_running_loop(), {}
    while True:
        for conn in list(connections):
            transport = getattr(conn, "transport", None)
            if transport is None or not transport.is_closing():
                continue
            first = since.setdefault(conn, loop.time())
            if loop.time() - first > grace_s:
                transport.abort()
        await asyncio.sleep(0.1)


def cmd_generate(args: argparse.Namespace) -> int:
    from tierserve.engine.api import resolve_path

    resolve_path(args.model)  # before torch: a mistyped model fails in a second
    from tierserve import LLM, SamplingParams

    setup_logging(args.log_level)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.generate([args.text], params)[0].outputs[0].text)
    return 0


def _add_shape_flags(p: argparse.ArgumentParser) -> None:
    """A device and an attention shape, for route and bench-backends (no GPU or model needed)."""
    p.add_argument("--device", default="cpu", help="device type: cpu or cuda")
    p.add_argument("--capability", default=None, help="CUDA compute capability, e.g. 9.0")
    p.add_argument("--dtype", default="float32", help="model dtype: float32, float16, bfloat16")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=9, help="query heads")
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, float16, bfloat16, fp8_e4m3")
    p.add_argument("--page-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--profile", default=None, help="bench-backends profile (default: "
                   "~/.cache/tierserve/backend_profile.json)")


def _route_query(args: argparse.Namespace):
    import torch

    from tierserve.kernels.router import RouteQuery
    cap = tuple(int(x) for x in args.capability.split(".")) if args.capability else None
    return RouteQuery(args.device, getattr(torch, args.dtype), args.kv_cache_dtype, args.head_dim,
                      args.num_heads, args.num_kv_heads, args.page_size, capability=cap)


def cmd_route(args: argparse.Namespace) -> int:
    import json

    from tierserve.kernels.profile import load_profile
    from tierserve.kernels.router import describe, route_phases
    try:
        q = _route_query(args)
        routes = route_phases(q, args.attention_backend, load_profile(args.profile),
                              sparse_decode=args.sparse)
    except (ValueError, AttributeError) as e:
        print(f"tierserve route: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"shape": q.shape_key, **{p: r.to_json() for p, r in routes.items()}},
                         indent=1))
    else:
        print(f"shape: {q.shape_key}\n{describe(routes)}")
    return 0


def cmd_bench_backends(args: argparse.Namespace) -> int:
    import torch

    from tierserve.kernels.bench import time_backend
    from tierserve.kernels.profile import save_profile
    from tierserve.kernels.router import PHASES, route
    if args.device == "cuda" and args.capability is None:
        args.capability = "%d.%d" % torch.cuda.get_device_capability()
    q = _route_query(args)
    timings: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        pq = dataclasses.replace(q, phase=phase)
        chosen = route(pq)
        valid = [chosen.backend] + [n for n, why in chosen.rejected.items()
                                    if why.startswith("lower priority")]
        timings[phase] = {}
        for name in valid:
            try:
                ms = time_backend(name, phase, q.num_heads, q.num_kv_heads, q.head_dim,
                                  q.page_size, q.kv_dtype, q.dtype, args.device)
            except RuntimeError as e:  # a kernel that cannot build here is left unmeasured
                print(f"{phase:8s} {name:12s} failed: {e}", file=sys.stderr)
                continue
            timings[phase][name] = ms
            print(f"{phase:8s} {name:12s} {ms:9.3f} ms")
    path = save_profile(args.profile, q.shape_key, timings)
    print(f"wrote {path} [{q.shape_key}]")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with each error in one line (`tierserve serve: ...`, no usage block), no
    abbreviated flags (`--max-num-seq 8` is not --max-num-seqs), and for an unknown flag the
    nearest real one (Python 3.11's argparse suggests none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        argv = sys.argv[1:] if args is None else list(args)
        name = next((a for a in argv if not a.startswith("-")), None)  # no value-taking options
        if self.commands and name is not None and name not in self.commands:
            hint = _did_you_mean(name, list(self.commands)) or \
                f" (the commands: {', '.join(self.commands)})"
            self.error(f"unknown command {name!r}{hint}")
        ns, extra = self.parse_known_args(argv, namespace)
        if extra:
            command = self.commands.get(getattr(ns, "command", None), self)
            command.error(_unrecognized(command, extra))
        return ns


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """`unknown flag --max-num-seq (did you mean --max-num-seqs?)`, or the stray argument."""
    flags = [arg.split("=", 1)[0] for arg in extra if arg.startswith("-")]
    if not flags:
        return f"unexpected argument{'s' * (len(extra) > 1)} {' '.join(extra)}"
    known = [opt for action in parser._actions for opt in action.option_strings]
    named = ", ".join(f"{flag}{_did_you_mean(flag, known, ' (did you mean {}?)')}"
                      for flag in flags)
    return f"unknown flag{'s' * (len(flags) > 1)} {named}"


def _did_you_mean(word: str, choices: list[str], form: str = "; did you mean {}?") -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return form.format(close[0]) if close else ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierserve")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "(not installed)"


def overview() -> str:
    """What `tierserve` alone prints, as `git` alone does: the commands, one line each."""
    lines = ["usage: tierserve [--version] [--help] <command> [<args>]", "", "commands:"]
    lines += [f"  {name:16s}{text}" for name, text in COMMANDS.items()]
    lines += ["", "`tierserve <command> --help` lists a command's flags."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tierserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    def command(name: str, func) -> argparse.ArgumentParser:
        p = parser.commands[name] = sub.add_parser(name, help=COMMANDS[name])
        p.set_defaults(func=func)
        return p

    serve = command("serve", cmd_serve)
    serve.add_argument("model_arg", nargs="?", metavar="MODEL",
                       help="the model, as --model (give one or the other)")
    serve.add_argument("--config", default=None,
                       help="YAML settings file, or a preset's name (default); unset: "
                       "$TIERSERVE_CONFIG. Every setting can also come from TIERSERVE_<SETTING> "
                       "(flag > environment > file > default)")
    _add_config_flags(serve)
    gen = command("generate", cmd_generate)
    gen.add_argument("text")
    gen.add_argument("--model", default=ServerConfig.model)
    gen.add_argument("--device", default=ServerConfig.device,
                     help="auto (a GPU when torch sees one), cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default=ServerConfig.dtype,
                     help="auto (bfloat16/float16 on a GPU, float32 on the CPU), float32, "
                     "float16 or bfloat16")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                     help="info (the default) shows the start-up on stderr as serve does: the "
                     "native build, the attention backend, the KV blocks")
    rt = command("route", cmd_route)
    _add_shape_flags(rt)
    rt.add_argument("--sparse", action="store_true",
                    help="sparse top-k decode is configured: decode goes to a backend that runs it, "
                         "as the engine routes it (prefill unchanged)")
    rt.add_argument("--attention-backend", default=None,
                    help="validate this choice (NAME or prefill=NAME,decode=NAME)")
    rt.add_argument("--json", action="store_true", help="machine-readable output")
    _add_shape_flags(command("bench-backends", cmd_bench_backends))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        print(overview(), end="")
        return 2
    try:
        return args.func(args)
    except Exception as e:
        if not _is_load_error(e):
            raise
        print(f"tierserve: error: {e}", file=sys.stderr)  # a wrong path, no GPU...: one line
        return 2


def _is_load_error(e: Exception) -> bool:
    """Imported only now: these modules pull in torch, seconds a flag's typo should not wait."""
    from tierserve.engine.api import DeviceError, ModelLoadError

    return isinstance(e, (ModelLoadError, DeviceError))


if __name__ == "__main__":
    sys.exit(main())
