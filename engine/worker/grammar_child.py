"""A grammar compiler in a process of its own, so that a compile can be stopped: xgrammar's
compile cannot be interrupted in a thread, but a process can be killed (grammar_pool.py). Both
ends: `Child` is the parent's handle, `main` the process.

    parent -> child   {"op": "init"}     + xgrammar TokenizerInfo JSON   once, after start
    child -> parent   {"ok": true}                                       ready
    parent -> child   {"op": "compile", "kind", "max_bytes"} + the text  one per job
    child -> parent   {"ok": true, "bytes", "seconds"}            it compiles, this large
                      {"ok": false, "error": reason, "seconds"}   xgrammar refused it
                      {"ok": false, "too_big": bytes, "seconds"}  it compiles past max_bytes

The compiled grammar itself stays here: xgrammar's JSON of it costs more than compiling it again
(serializing and loading took 3-4x the compile for every schema measured, from 1 ms to 16 s of
compile, and a 15 KB schema's JSON was 239 MB), so the parent compiles it again, now known to
end, and how soon and how large.

Each frame is a 12-byte prefix (header length u32, payload length u64, little-endian), the
JSON header, then the payload. The child exits at end of input and when its parent dies. It
imports only xgrammar's compiler (see `_import_xgrammar`), so it starts in about a second and
holds ~50 MB until it compiles."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
import types
from typing import BinaryIO

_PREFIX = struct.Struct("<IQ")
TRIM_AFTER_BYTES = 1 << 20
"""A compile of at least this many bytes is followed by malloc_trim (smaller ones leave little)."""


def send(stream: BinaryIO, head: dict, payload: bytes = b"") -> None:
    h = json.dumps(head).encode()
    for data in (_PREFIX.pack(len(h), len(payload)) + h, payload):
        view = memoryview(data)
        while view:  # an unbuffered pipe may take part of a write
            view = view[stream.write(view):]
    stream.flush()


def recv(stream: BinaryIO) -> tuple[dict, bytes] | None:
    """The next frame, or None at end of input (the other side closed or died)."""
    prefix = _read(stream, _PREFIX.size)
    if prefix is None:
        return None
    hlen, plen = _PREFIX.unpack(prefix)
    head, payload = _read(stream, hlen), _read(stream, plen)
    if head is None or payload is None:
        return None
    return json.loads(head), payload


def _read(stream: BinaryIO, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


class _TimedOut:
    """A run that passed its budget."""


TIMED_OUT = _TimedOut()
START_TIMEOUT_S = 120.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Child:
    """One grammar_child process: started, handed the tokenizer, then one job at a time."""

    def __init__(self, init: bytes, lean: bool, nice: int):
        cmd = [sys.executable, "-m", "tierserve.engine.worker.grammar_child", "--nice", str(nice)]
        self.proc = subprocess.Popen(cmd + (["--lean"] if lean else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        reply = self.run({"op": "init"}, init, START_TIMEOUT_S)
        if not isinstance(reply, tuple) or not reply[0].get("ok"):
            self.close()
            raise RuntimeError(f"the grammar compiler process did not start (exit code "
                               f"{self.proc.returncode})")

    def run(self, head: dict, payload: bytes,
            budget: float | None) -> tuple[dict, bytes] | _TimedOut | None:
        """The reply, TIMED_OUT past `budget` seconds, or None when the process died."""
        try:
            send(self.proc.stdin, head, payload)
            if budget is not None and not select.select([self.proc.stdout], [], [], budget)[0]:
                return TIMED_OUT
            return recv(self.proc.stdout)
        except (OSError, ValueError):  # a closed pipe: killed meanwhile
            return None

    def cpu_s(self) -> float | None:
        """CPU seconds the process has used (Linux /proc; None elsewhere or once reaped)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        self.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and a process that once
    held a large grammar would keep its peak RSS). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _import_xgrammar(lean: bool):
    """xgrammar's GrammarCompiler and TokenizerInfo. `lean`: without the package's __init__,
    which imports torch (through tvm_ffi and xgrammar.testing, ~7 s and ~200 MB here) and
    transformers (for Hugging Face tokenizers): a compile needs neither, the tokenizer comes as
    JSON. The parent starts a child without `lean` if a lean one fails to start."""
    if not lean:
        import xgrammar

        return xgrammar.GrammarCompiler, xgrammar.TokenizerInfo
    spec = importlib.util.find_spec("xgrammar")
    package = types.ModuleType("xgrammar")
    package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
    transformers = types.ModuleType("transformers")  # tokenizer_info's isinstance checks only
    transformers.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
    transformers.PreTrainedTokenizerFast = type("PreTrainedTokenizerFast",
                                                (transformers.PreTrainedTokenizerBase,), {})
    sys.modules.update(xgrammar=package, transformers=transformers, torch=None)
    import xgrammar.exception  # noqa: F401  (registers the binding's error types)
    import xgrammar.load_binding  # noqa: F401
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.tokenizer_info import TokenizerInfo

    return GrammarCompiler, TokenizerInfo


def compile_grammar(compiler, kind: str, text: str):
    """`text` of `kind` compiled by an xgrammar GrammarCompiler (here or in the parent)."""
    # no free whitespace (one line, ", " and ": "): a small model at temperature 1 can
    # otherwise write whitespace until max_tokens (any_whitespace lets it)
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _job(compiler, head: dict, text: str) -> dict:
    t0 = time.perf_counter()
    try:
        compiled = compile_grammar(compiler, head["kind"], text)
    except Exception as e:  # xgrammar raises RuntimeError, ValueError, TypeError and its own
        return {"ok": False, "error": _first_line(e), "seconds": time.perf_counter() - t0}
    size, took = compiled.memory_size_bytes, time.perf_counter() - t0
    if head.get("max_bytes") is not None and size > head["max_bytes"]:
        return {"ok": False, "too_big": size, "seconds": took}
    return {"ok": True, "bytes": size, "seconds": took}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL when the parent goes, even mid-compile
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:
        return
    if "--nice" in argv:
        os.nice(int(argv[argv.index("--nice") + 1]))
    # the protocol owns stdout: anything a library prints goes to stderr instead
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    GrammarCompiler, TokenizerInfo = _import_xgrammar("--lean" in argv)
    frame = recv(inp)
    if frame is None:
        return
    info = TokenizerInfo.deserialize_json(frame[1].decode())
    compiler = GrammarCompiler(info, max_threads=1, cache_enabled=False)
    send(out, {"ok": True})
    while (frame := recv(inp)) is not None:
        head = _job(compiler, frame[0], frame[1].decode())
        send(out, head)
        if head.get("bytes", head.get("too_big", 0)) >= TRIM_AFTER_BYTES:
            malloc_trim()  # the grammar is gone: hand its pages back


if __name__ == "__main__":
    main(sys.argv[1:])
