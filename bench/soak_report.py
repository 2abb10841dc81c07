"""A soak's figures (bench/soak.py), the checks it must pass, and how they print and plot.

    check      passes when
    ---------  ---------------------------------------------------------------------------------
    requests   no failure: every reference request got its reference answer or a clean 429,
               every bad request its clean 4xx, no client thread got stuck
    coverage   every kind of traffic happened: completions and chat, streamed and not, 429s,
               every bad case, every kind of disconnect, and the server aborted requests whose
               client went away
    faults     each injected fault shows in the tier's error counters as failed requests or
               writes (S3: connect, timeout, http_5xx; disk: read_only, no_space, io)
    tiers      blocks were loaded from the tiers during the soak, from each required one
    recovery   after each tier's last restore, once its back-off (soak.BACKOFF) could end, the
               tier stored new blocks; the S3 breaker is closed at the end
    pool       idle after the soak: nothing running or waiting, every KV block free (usage 0)
    admission  exactly max_in_flight reference requests at once on the idle server: all admitted,
               all answered as the reference (the in-flight count leaked nothing)
    alive      /health 200; no 500 counted, no traceback in the server log
    fds        fds after - at the baseline <= FD_SLACK, and no fd other than a socket more
    threads    threads after - at the baseline <= THREAD_SLACK
    rss        RSS after - at the baseline <= RSS_SLACK + the cpu tier's growth
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

MIB = 1 << 20
FAULT_SPANS = (("disk_ro", "disk_rw", "disk read-only", "tab:orange"),
               ("s3_kill", "s3_start", "S3 down", "tab:red"))
S3_FAILURES = ("connect", "timeout", "http_5xx")
DISK_FAILURES = ("read_only", "no_space", "io")
"""Error kinds of a failed request or write (each counts toward a back-off); "unavailable" counts
what a tier skipped while backing off."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    config: dict
    disk_fault: str
    """How the disk was made to refuse writes (soak.DiskFault)."""
    duration_s: float
    outcomes: dict[str, int]
    failures: list[dict]
    faults: list[dict]
    timeline: list[dict]
    baseline: dict
    final: dict
    base_metrics: dict[str, float]
    final_metrics: dict[str, float]
    idle: tuple[bool, bool]
    """Whether the server was idle at the baseline and at the end (soak.Soak.quiesce)."""
    after: dict
    server_log_tracebacks: int
    limits: dict
    checks: list[Check] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.checks = self.checks or evaluate(self)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    def problems(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def figures(self) -> dict:
        b, f = self.baseline, self.final
        soak_rows = [r for r in self.timeline if 0 <= r["t"] <= self.duration_s]
        rss = [r["rss_bytes"] for r in soak_rows] or [f["rss_bytes"]]
        late = [r for r in soak_rows if r["t"] >= self.duration_s / 2]  # past the ramp-up
        return {"requests": sum(v for k, v in self.outcomes.items() if k != "burst"),
                "failures": len(self.failures),
                "rss_baseline_mib": round(b["rss_bytes"] / MIB, 1),
                "rss_final_mib": round(f["rss_bytes"] / MIB, 1),
                "rss_peak_mib": round(max(rss) / MIB, 1),
                "rss_growth_mib": round((f["rss_bytes"] - b["rss_bytes"]) / MIB, 1),
                "rss_anon_growth_mib": round((f["rss_anon_bytes"] - b["rss_anon_bytes"]) / MIB, 1),
                "rss_slope_mib_per_hour_2nd_half": round(rss_slope(late) * 3600 / MIB, 1),
                "fds_growth": f["fds"] - b["fds"], "threads_growth": f["threads"] - b["threads"],
                "fds": (b["fds"], f["fds"]), "threads": (b["threads"], f["threads"])}

    def write_json(self, path: str) -> None:
        d = asdict(self)
        d["figures"], d["passed"] = self.figures(), self.passed
        with open(path, "w") as fh:
            json.dump(d, fh, indent=1, default=str)

    def plot(self, path: str) -> None:
        plot(self, path)


def rss_slope(rows: list[dict]) -> float:
    """Least-squares bytes per second of RSS over the rows."""
    if len(rows) < 2:
        return 0.0
    ts, ys = [r["t"] for r in rows], [r["rss_bytes"] for r in rows]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


# ---- checks ------------------------------------------------------------------------------------


def evaluate(r: Report) -> list[Check]:
    return [_requests(r), _coverage(r), *_faults(r), _pool(r), _admission(r), _alive(r),
            *_growth(r)]


def _requests(r: Report) -> Check:
    kinds = Counter(f["kind"] for f in r.failures)
    first = "; ".join(f"[{f['at']}s] {f['kind']}: {f['detail']}" for f in r.failures[:3])
    return Check("requests", not r.failures,
                 f"{len(r.failures)} failures {dict(kinds)}: {first}" if r.failures else
                 f"{sum(r.outcomes.values())} outcomes, all clean")


def _coverage(r: Report) -> Check:
    want = ["ok completion", "ok completion stream", "ok chat", "ok chat stream", "ok fresh",
            "429 queue_full", "burst", "disconnect mid_stream", "disconnect before_answer",
            "disconnect mid_body"]
    missing = [k for k in want if not r.outcomes.get(k)]
    bad = [k for k in r.outcomes if k[:1] == "4" and k != "429 queue_full"]
    key = "vllm:request_success_total{finished_reason=abort}"
    aborts = r.final_metrics.get(key, 0.0) - r.base_metrics.get(key, 0.0)
    return Check("coverage", not missing and len(bad) >= r.limits["bad_cases"] and aborts > 0,
                 f"missing: {missing}; bad cases seen {len(bad)}/{r.limits['bad_cases']}; "
                 f"requests the server aborted for a gone client: {aborts:.0f}")


def _tier(m: dict[str, float], family: str, tier: str, kinds=None) -> float:
    prefix = f"tierserve:kv_tier_{family}{{"
    total = 0.0
    for key, v in m.items():
        if key.startswith(prefix) and f"tier={tier}" in key and \
                (kinds is None or any(f"kind={k}" in key for k in kinds)):
            total += v
    return total


def _faults(r: Report) -> list[Check]:
    b, f = r.base_metrics, r.final_metrics
    used = {t: _tier(f, "loaded_blocks_total", t) - _tier(b, "loaded_blocks_total", t)
            for t in ("cpu", "disk", "s3")}
    required = r.limits["require_loads_from"]
    checks = [Check("tiers", sum(used.values()) > 0 and all(used[t] > 0 for t in required),
                    f"blocks loaded during the soak: {used} (required from: "
                    f"{', '.join(required) or 'any'})")]
    if not r.faults:
        return checks
    s3 = _tier(f, "errors_total", "s3", S3_FAILURES) - _tier(b, "errors_total", "s3", S3_FAILURES)
    disk = _tier(f, "errors_total", "disk", DISK_FAILURES) - \
        _tier(b, "errors_total", "disk", DISK_FAILURES)
    actions = Counter(x["action"] for x in r.faults)
    checks.append(Check("faults", s3 > 0 and disk > 0,
                        f"injected {dict(actions)}; tier errors: s3 {s3:.0f}, disk {disk:.0f}"))
    checks.append(_recovery(r))
    return checks


def _recovery(r: Report) -> Check:
    """New blocks stored after the last restore of each tier, where its back-off could end."""
    f, notes, ok = r.final_metrics, [], True
    for tier, start, end, kinds in (("s3", "s3_kill", "s3_start", S3_FAILURES),
                                    ("disk", "disk_ro", "disk_rw", DISK_FAILURES)):
        restored = max(x["done_t"] for x in r.faults if x["action"] == end)
        at = [row for row in r.timeline if row["t"] >= restored]
        if not at:
            continue
        grew = _tier(f, "stored_blocks_total", tier) - at[0]["stored"].get(tier, 0.0)
        writable = _writable_at(r, tier, max(x["t"] for x in r.faults if x["action"] == start),
                                kinds)
        due = r.duration_s - max(restored, writable) >= 5.0
        notes.append(f"{tier}: {grew:.0f} blocks stored after the restore at {restored:.0f}s"
                     + ("" if due else f" (not checked: its back-off ends at {writable:.0f}s)"))
        ok &= grew > 0 or not due
    breaker = f.get("tierserve:kv_tier_breaker_state{state=closed,tier=s3}", 0.0)
    notes.append(f"s3 breaker {'closed' if breaker == 1 else 'not closed'}")
    return Check("recovery", ok and breaker == 1, "; ".join(notes))


def _writable_at(r: Report, tier: str, fault_t: float, kinds: tuple[str, ...]) -> float:
    """When the tier's back-off after its last failure since `fault_t` ends, at the latest: the
    first sample that shows the last failure (a sample is taken after what it counts), plus the
    back-off doubled once per failed probe (failures beyond those that opened the breaker)."""
    first, longest, opening = r.limits["backoff"][tier]

    def failures(row: dict) -> float:
        return sum(v for k, v in row["tier_errors"].items()
                   if k.split("/")[0] == tier and k.split("/")[-1] in kinds)

    rows = [row for row in r.timeline if row["tier_errors"]]
    before = max((failures(x) for x in rows if x["t"] <= fault_t), default=0.0)
    last = failures(rows[-1]) if rows else before
    if last <= before:
        return fault_t
    last_t = min(x["t"] for x in rows if x["t"] > fault_t and failures(x) >= last)
    probes = max(0, int(last - before) - opening)
    return last_t + min(longest, first * 2 ** probes)


def _pool(r: Report) -> Check:
    f = r.final_metrics
    total, free = f["tierserve:kv_cache_blocks_total"], f["tierserve:kv_cache_blocks_free"]
    running, waiting = f["vllm:num_requests_running"], f["vllm:num_requests_waiting"]
    ok = free == total and running == 0 and waiting == 0 and f["vllm:kv_cache_usage_perc"] == 0
    return Check("pool", ok and r.idle[1], f"free blocks {free:.0f}/{total:.0f}, running "
                 f"{running:.0f}, waiting {waiting:.0f}, usage {f['vllm:kv_cache_usage_perc']}")


def _admission(r: Report) -> Check:
    outs = r.after["full_queue_outcomes"]
    bad = [o for o in outs if o != "ok"]
    return Check("admission", bool(outs) and not bad,
                 f"{len(outs) - len(bad)}/{len(outs)} admitted and correct" +
                 (f": {bad[:2]}" if bad else ""))


def _alive(r: Report) -> Check:
    e500 = sum(v for k, v in r.final_metrics.items()
               if k.startswith("tierserve:http_errors_total") and "status=5" in k)
    ok = r.after["health"] == 200 and e500 == 0 and r.server_log_tracebacks == 0
    return Check("alive", ok, f"/health {r.after['health']}, 5xx counted {e500:.0f}, tracebacks "
                              f"in the server log {r.server_log_tracebacks}")


def _growth(r: Report) -> list[Check]:
    b, f, lim = r.baseline, r.final, r.limits
    other_b = b["fds"] - b["fd_kinds"].get("socket", 0)
    other_f = f["fds"] - f["fd_kinds"].get("socket", 0)
    dfd, dthr = f["fds"] - b["fds"], f["threads"] - b["threads"]
    cpu_growth = max(0.0, _tier(r.final_metrics, "used_bytes", "cpu") -
                     _tier(r.base_metrics, "used_bytes", "cpu"))
    queues = lim.get("store_queues", 0)
    drss, allowed = f["rss_bytes"] - b["rss_bytes"], lim["rss_slack"] + cpu_growth + queues
    return [
        Check("fds", dfd <= lim["fd_slack"] and other_f <= other_b,
              f"{b['fds']} -> {f['fds']} ({dfd:+d}, at most +{lim['fd_slack']}); by kind "
              f"{b['fd_kinds']} -> {f['fd_kinds']}"),
        Check("threads", dthr <= lim["thread_slack"],
              f"{b['threads']} -> {f['threads']} ({dthr:+d}, at most +{lim['thread_slack']})"),
        Check("rss", drss <= allowed,
              f"{b['rss_bytes'] / MIB:.0f} -> {f['rss_bytes'] / MIB:.0f} MiB "
              f"({drss / MIB:+.1f}, at most +{allowed / MIB:.0f}: slack "
              f"{lim['rss_slack'] / MIB:.0f} + cpu tier growth {cpu_growth / MIB:.0f} + store "
              f"queues {queues / MIB:.0f})")]


# ---- printing ----------------------------------------------------------------------------------


def progress_line(row: dict, faults: list[dict]) -> str:
    o = Counter(row["outcomes"])
    ok = sum(v for k, v in o.items() if k.startswith("ok"))
    bad = sum(v for k, v in o.items() if k[:1] == "4" and k != "429 queue_full")
    disc = sum(v for k, v in o.items() if k.startswith("disconnect"))
    fail = sum(v for k, v in o.items() if k.startswith("FAIL"))
    errs = ",".join(f"{k}={v:.0f}" for k, v in sorted(row["tier_errors"].items())
                    if not k.endswith("/miss")) or "-"
    return (f"[{row['t']:7.1f}s] ok {ok} 429 {o['429 queue_full']} 4xx {bad} disconnects {disc} "
            f"FAIL {fail} | faults {len(faults)} tier errors {errs} | RSS "
            f"{row['rss_bytes'] / MIB:.0f} MiB fds {row['fds']} threads {row['threads']} | "
            f"running {row['running']} waiting {row['waiting']}")


def table(r: Report) -> str:
    fig = r.figures()
    lines = [f"soak: {r.duration_s:.0f}s with faults after {r.config['warmup_s']:.0f}s of warm-up,"
             f" {r.config['clients']} client threads; disk fault: {r.disk_fault}", "",
             "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(r.outcomes.items())]
    lines += ["", "| fault | at (s) |", "|---|---|"]
    lines += [f"| {x['action']} | {x['t']:.1f} |" for x in r.faults]
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in fig.items()]
    lines += ["", "| check | ok | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.detail} |" for c in r.checks]
    return "\n".join(lines)


def plot(r: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r.timeline
    t = [x["t"] for x in rows]
    series = (("RSS (MiB)", {"": [x["rss_bytes"] / MIB for x in rows]}),
              ("file descriptors", {"all": [x["fds"] for x in rows],
                                    "sockets": [x["sockets"] for x in rows]}),
              ("threads", {"": [x["threads"] for x in rows]}),
              ("requests/s", {"all outcomes": _rate(rows, lambda k: k != "burst"),
                              "answered ok": _rate(rows, lambda k: k.startswith("ok"))}))
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 9), sharex=True)
    for ax, (label, lines) in zip(axes, series):
        for name, ys in lines.items():
            ax.plot(t, ys, lw=1.2, label=name or None)
        if len(lines) > 1:
            ax.legend(loc="upper left", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.axvspan(min(t, default=0), 0, color="0.9", lw=0)
        for start, end, name, colour in FAULT_SPANS:
            for i, (a, b) in enumerate(_spans(r.faults, start, end, r.duration_s)):
                ax.axvspan(a, b, color=colour, alpha=0.2, lw=0,
                           label=name if ax is axes[0] and i == 0 else None)
    axes[0].legend(loc="lower right", fontsize=8)  # the fault spans
    axes[-1].set_xlabel("seconds since the faults may start (grey: warm-up)")
    fig.suptitle(f"tierserve soak: {r.duration_s:.0f}s, {fig_title(r)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rate(rows: list[dict], counted) -> list[float]:
    """Outcomes per second between samples, of the outcome kinds `counted` accepts."""
    total = [sum(v for k, v in x["outcomes"].items() if counted(k)) for x in rows]
    t = [x["t"] for x in rows]
    return [0.0] + [(b - a) / (tb - ta) if tb > ta else 0.0
                    for a, b, ta, tb in zip(total, total[1:], t, t[1:])]


def fig_title(r: Report) -> str:
    f = r.figures()
    return (f"{f['requests']} requests, {f['failures']} failures, RSS {f['rss_growth_mib']:+.0f} "
            f"MiB, fds {f['fds_growth']:+d}, threads {f['threads_growth']:+d}")


def _spans(faults: list[dict], start: str, end: str, until: float) -> list[tuple[float, float]]:
    out, opened = [], None
    for x in faults:
        if x["action"] == start:
            opened = x["t"]
        elif x["action"] == end and opened is not None:
            out.append((opened, x["done_t"]))
            opened = None
    return out + ([(opened, until)] if opened is not None else [])
