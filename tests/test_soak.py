"""A short soak (bench/soak.py, the same driver): `tierserve serve` as a subprocess with the cpu,
disk and s3 tiers under mixed traffic, bad input, client disconnects and bursts past its queue,
while the disk tier turns read-only and back and S3 (a real `weed mini`) is killed and restarted.
Afterwards every check of bench/soak_report.py must pass: reference answers token for token, clean
4xx errors, a whole block pool and admission count, no fd, thread or memory growth.

The other tests here show that those checks fail when the thing they watch is broken."""

from __future__ import annotations

import copy
import os
import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    """A bench module by path (bench/ is no package); soak.py puts bench/ on sys.path itself."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


soak = _load("soak")
soak_report = _load("soak_report")
soak_traffic = _load("soak_traffic")


@pytest.mark.slow
def test_short_soak_under_load_faults_and_bad_input(tmp_path):
    """~40 s of traffic after a 5 s warm-up (no faults in it: no time); about 80 s on 2 cores. The
    fault cycle is the bench's, squeezed: disk read-only at 2-8 s (its 30 s back-off ends before
    the run does, so the disk's recovery is checked too), S3 down at 14-22 s. The disk tier is
    larger than the bench's: its stores pause for most of this short run (read-only, then the
    back-off), so it must still hold the fixed prompts' blocks from the reference run for the
    disk to serve loads."""
    cfg = soak.SoakConfig(duration_s=40.0, warmup_s=5.0, warmup_faults=False, prompts=6,
                          sample_s=2.0, progress_s=10.0, disk_tier="160MiB",
                          disk_tmpfs="256m", require_loads_from=())
    report = soak.run_soak(cfg, tmp_path)
    report.write_json(str(tmp_path / "soak.json"))
    report.plot(str(tmp_path / "soak.png"))
    assert report.passed, "\n".join(report.problems()) + "\n\n" + soak_report.table(report)
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    # the server really was full (running + waiting at max_num_seqs + max_queue; waiting alone
    # may pass max_queue while a preempted request waits), and the faults really happened
    assert max((r["running"] or 0) + (r["waiting"] or 0) for r in report.timeline) == \
        soak.MAX_NUM_SEQS + soak.MAX_QUEUE
    assert [f["action"] for f in report.faults] == ["disk_ro", "disk_rw", "s3_kill", "s3_start"]


# ---- the checks catch what they are for --------------------------------------------------------


def _passing() -> soak_report.Report:
    """A report of an idle, healthy run: every check passes; each test below breaks one thing."""
    idle = {"tierserve:kv_cache_blocks_total": 91.0, "tierserve:kv_cache_blocks_free": 91.0,
            "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0,
            "tierserve:kv_tier_breaker_state{state=closed,tier=s3}": 1.0,
            "tierserve:kv_tier_used_bytes{tier=cpu}": 20.0 * (1 << 20)}
    final = dict(idle)
    final["vllm:request_success_total{finished_reason=abort}"] = 4.0
    for tier in ("cpu", "disk", "s3"):
        final[f"tierserve:kv_tier_loaded_blocks_total{{tier={tier}}}"] = 5.0
        final[f"tierserve:kv_tier_stored_blocks_total{{tier={tier}}}"] = 50.0
    final["tierserve:kv_tier_errors_total{kind=connect,tier=s3}"] = 3.0
    final["tierserve:kv_tier_errors_total{kind=read_only,tier=disk}"] = 1.0
    proc = {"rss_bytes": 1800 << 20, "rss_anon_bytes": 1700 << 20, "threads": 22, "fds": 12,
            "fd_kinds": {"file": 3, "socket": 8, "anon_inode": 1}, "thread_names": {}}
    outcomes = {k: 1 for k in ("ok completion", "ok completion stream", "ok chat",
                               "ok chat stream", "ok fresh", "429 queue_full", "burst",
                               "disconnect mid_stream", "disconnect before_answer",
                               "disconnect mid_body", "400 a", "404 b")}
    faults = [{"t": t, "done_t": t, "action": a} for t, a in
              ((2.0, "disk_ro"), (8.0, "disk_rw"), (14.0, "s3_kill"), (22.0, "s3_start"))]
    errors = [{}, {"disk/read_only": 1.0}, {"disk/read_only": 1.0, "s3/connect": 3.0},
              {"disk/read_only": 1.0, "s3/connect": 3.0, "s3/unavailable": 9.0}]
    timeline = [{"t": t, "tier_errors": e, "stored": {"s3": 10.0, "disk": 10.0}}
                for t, e in zip((1.0, 4.0, 16.0, 23.0), errors)]
    return soak_report.Report(
        config={"warmup_s": 5, "clients": 12}, disk_fault="tmpfs", duration_s=40.0,
        outcomes=outcomes, failures=[], faults=faults, timeline=timeline, baseline=proc,
        final=copy.deepcopy(proc), base_metrics=idle, final_metrics=final, idle=(True, True),
        after={"health": 200, "full_queue_outcomes": ["ok"] * 8}, server_log_tracebacks=0,
        limits={"fd_slack": soak.FD_SLACK, "thread_slack": soak.THREAD_SLACK,
                "rss_slack": soak.RSS_SLACK, "backoff": soak.BACKOFF,
                "bad_cases": 2, "require_loads_from": ("cpu", "disk", "s3")})


def _failed(report: soak_report.Report) -> set[str]:
    return {c.name for c in soak_report.evaluate(report) if not c.ok}


def test_the_passing_skeleton_passes():
    assert _failed(_passing()) == set()


@pytest.mark.parametrize("break_it, check", [
    (lambda r: r.failures.append({"kind": "wrong_output", "detail": "x", "at": 1.0}), "requests"),
    (lambda r: r.outcomes.pop("disconnect mid_body"), "coverage"),
    (lambda r: r.outcomes.pop("400 a"), "coverage"),
    (lambda r: r.final_metrics.pop("vllm:request_success_total{finished_reason=abort}"),
     "coverage"),
    (lambda r: r.final_metrics.update({"tierserve:kv_cache_blocks_free": 90.0}), "pool"),
    (lambda r: r.final_metrics.update({"vllm:num_requests_waiting": 1.0}), "pool"),
    (lambda r: r.after.update(full_queue_outcomes=["ok"] * 7 + ["RateLimitError: 429"]),
     "admission"),
    (lambda r: r.after.update(health=503), "alive"),
    (lambda r: r.final_metrics.update({"tierserve:http_errors_total{status=500}": 1.0}), "alive"),
    (lambda r: setattr(r, "server_log_tracebacks", 1), "alive"),
    (lambda r: r.final.update(fds=12 + soak.FD_SLACK + 1), "fds"),
    (lambda r: (r.final.update(fds=13), r.final["fd_kinds"].update(file=4)), "fds"),  # a file
    (lambda r: r.final.update(threads=22 + soak.THREAD_SLACK + 1), "threads"),
    (lambda r: r.final.update(rss_bytes=(1800 << 20) + soak.RSS_SLACK + (1 << 20)), "rss"),
    (lambda r: r.final_metrics.pop("tierserve:kv_tier_loaded_blocks_total{tier=s3}"), "tiers"),
    (lambda r: r.final_metrics.pop("tierserve:kv_tier_errors_total{kind=connect,tier=s3}"),
     "faults"),
    (lambda r: r.final_metrics.update({"tierserve:kv_tier_stored_blocks_total{tier=s3}": 10.0}),
     "recovery"),
    (lambda r: r.final_metrics.update({"tierserve:kv_tier_stored_blocks_total{tier=disk}": 10.0}),
     "recovery"),
    (lambda r: r.final_metrics.pop("tierserve:kv_tier_breaker_state{state=closed,tier=s3}"),
     "recovery"),
])
def test_each_check_fails_when_its_behaviour_is_broken(break_it, check):
    r = _passing()
    break_it(r)
    assert _failed(r) == {check}


def test_recovery_is_required_only_once_the_back_off_after_the_last_failure_ends():
    """The disk failed once at 2-4 s (the sample at 4 s shows it): writable from 4 + 30 s."""
    r = _passing()
    r.final_metrics["tierserve:kv_tier_stored_blocks_total{tier=disk}"] = 10.0  # no new stores
    r.duration_s = 4.0 + soak.BACKOFF["disk"][0] + 1.0  # the back-off ended only 1 s ago
    assert _failed(r) == set()
    r.duration_s = 4.0 + soak.BACKOFF["disk"][0] + 6.0
    assert _failed(r) == {"recovery"}
    r.timeline[-1]["tier_errors"]["disk/read_only"] = 2.0  # a failed probe: the wait doubles
    assert _failed(r) == set()


def _error(status: int, body: str) -> httpx.Response:
    return httpx.Response(status, text=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("response, problem", [
    (_error(500, '{"error": {"message": "internal server error", "type": "server_error", '
                 '"param": null, "code": "internal_error"}}'), "status 500"),
    (_error(400, 'Traceback (most recent call last):\n  File "x.py"'), "stack trace"),
    (_error(400, '{"detail": "bad"}'), "not an OpenAI error body"),
    (_error(400, '{"error": {"message": "max_tokens: bad", "type": "t", "code": "invalid_type"}}'),
     "lacks ['param']"),
    (_error(400, '{"error": {"message": "bad value", "type": "t", "param": "temperature", '
                 '"code": "invalid_type"}}'), "param 'temperature'"),
    (_error(400, '{"error": {"message": "a bad value", "type": "t", "param": "max_tokens", '
                 '"code": "invalid_type"}}'), "does not name 'max_tokens'"),
    (_error(400, '{"error": {"message": "max_tokens: bad", "type": "t", "param": "max_tokens", '
                 '"code": "invalid_value"}}'), "code 'invalid_value'"),
])
def test_a_bad_request_answer_is_checked_for_status_shape_field_and_code(response, problem):
    found = soak_traffic.check_error(response, 400, "max_tokens", "invalid_type")
    assert found is not None and problem in found
    ok = _error(400, '{"error": {"message": "max_tokens: Input should be a valid integer", '
                     '"type": "invalid_request_error", "param": "max_tokens", '
                     '"code": "invalid_type"}}')
    assert soak_traffic.check_error(ok, 400, "max_tokens", "invalid_type") is None


@pytest.mark.parametrize("mode", soak.DiskFault.MODES)
def test_the_disk_fault_makes_writes_fail_and_restores_the_folder(tmp_path, mode):
    if mode == "chmod" and os.geteuid() == 0:
        pytest.skip("root ignores permissions: chmod cannot make a folder read-only")
    disk = soak.DiskFault(tmp_path / "disk", "4m", modes=(mode,))
    try:
        disk.__enter__()
    except RuntimeError:
        pytest.skip(f"{mode} is not possible here")
    try:
        (disk.dir / "kept").write_bytes(b"kv")
        disk.break_()
        with pytest.raises(OSError):
            (disk.dir / "new").write_bytes(b"kv")
        disk.restore()
        (disk.dir / "new").write_bytes(b"kv")
        assert sorted(p.name for p in disk.dir.iterdir()) == ["kept", "new"]
    finally:
        disk.__exit__(None, None, None)


def test_a_short_soak_may_require_loads_from_any_tier_but_not_none():
    r = _passing()
    r.limits["require_loads_from"] = ()
    r.final_metrics.pop("tierserve:kv_tier_loaded_blocks_total{tier=s3}")
    assert _failed(r) == set()
    for tier in ("cpu", "disk"):
        r.final_metrics.pop(f"tierserve:kv_tier_loaded_blocks_total{{tier={tier}}}")
    assert _failed(r) == {"tiers"}
