"""Time to first token when a long prefix is cold, in the device cache, or only in one KV tier.

    python bench/tiers.py                                   # 5 repetitions, 2,000-token prefix
    python bench/tiers.py --json bench/out/tiers.json --plot docs/tiers_ttft.png
    python bench/tiers.py --kv-cache-dtype float16          # half the bytes to move
    python bench/tiers.py --repeat 1 --prefix-tokens 64     # a quick check that it runs (~1 min)

One request of `--prefix-tokens` tokens of real text (the Apache license shipped with the model)
plus a few suffix tokens of its own per repetition, max_tokens 1, greedy. TTFT is the engine's
own first_token - arrival (monotonic; the prompt is token ids, so no tokenizing is timed).

    condition  engine                 before each timed request
    ---------  ---------------------  ---------------------------------------------------------
    cold       no tiers               a cache salt of its own: no block can hit
    device     no tiers (the same)    nothing: the prefix is still in the device prefix cache
    cpu        cpu tier only          flushed; the prefix is checked in the tier; device reset
    disk       disk tier only         as cpu, and the tier's files dropped from the page cache
    s3         s3 tier only           as cpu; SeaweedFS `weed mini` on loopback, started here

Each engine stores the prefix once (a full run, then a flush) and serves one untimed hit before
the timed ones, so one-time costs (thread pools, S3 connections) are not counted. The conditions
take turns within each repetition, so a machine that slows down mid-run slows all of them alike.
Every tier hit must cover the whole prefix, read from that tier alone; the script stops if not.

Targets (the tiers issue): cpu and disk at most 1/5 of the cold median, s3 at most 1/2.

The tier policy under a slow S3 (interactive and batch requests) is bench/tiers_slo.py. The old
command line `python bench/tiers.py --slo [--slo-* flags]` still runs it, with the same flags.
What both scripts share is bench/tiers_common.py (engines, prompt text, SeaweedFS) and
bench/tables.py (the Markdown table, the JSON and the plot).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# tiers_common first: it puts the checkout and tests/ (s3_fixtures, delay_proxy) on sys.path
from tiers_common import (SUFFIX_TOKENS, TIERS, add_common_args, corpus_ids, kv_dtype_name,
                          log, make_llm, prefix_keys, run_one, with_seaweed)
from tables import markdown_table, pyplot, save_figure, save_outputs
import tiers_slo
from s3_fixtures import BUCKET
from tierserve import LLM
from tierserve.engine.kv_tiers.config import TierConfig

TARGETS = {"cpu": 1 / 5, "disk": 1 / 5, "s3": 1 / 2}
"""Most a tier hit's median TTFT may be, as a fraction of the cold median."""


@dataclass
class Sample:
    """One timed request."""

    ttft_s: float
    wait_s: float
    """Arrival until the first step that computes it starts: tier lookup, load and copy in."""
    cached_tokens: int
    bytes_loaded: int
    """Payload bytes the tier under test read for it (0 without tiers)."""
    first_token: int
    policy: str | None
    """The engine's tier-policy decision for it (X-KV-Policy), where the engine reports one."""


@dataclass
class Condition:
    name: str
    llm: LLM
    samples: list[Sample] = field(default_factory=list)


# ---- the prompt and the tier engines ------------------------------------------------------------

def prompts(corpus: list[int], prefix_len: int, n: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and n prompts that each add distinct suffix tokens to it. Suffix i
    is the text that follows the prefix, shifted by i tokens (real text, different per prompt)."""
    prefix = corpus[:prefix_len]
    return prefix, [prefix + corpus[prefix_len + i:prefix_len + i + SUFFIX_TOKENS]
                    for i in range(n)]


def tier_config(name: str, tmp: Path, endpoint: str | None) -> TierConfig:
    if name == "cpu":
        return TierConfig(tiers=("cpu",), cpu_bytes=4 << 30)
    if name == "disk":
        return TierConfig(tiers=("disk",), disk_dir=str(tmp / "kv-disk"), disk_bytes=4 << 30)
    return TierConfig(tiers=("s3",), s3_bucket=BUCKET, s3_endpoint_url=endpoint,
                      s3_region="us-east-1", s3_prefix=f"bench-{uuid.uuid4().hex[:8]}")


# ---- one condition, one repetition ---------------------------------------------------------------

def prepare_tier(c: Condition, prefix: list[int]) -> None:
    """The prefix sits in the tier and nowhere closer: writes flushed, every block present,
    the device prefix cache forgotten, and (disk) the files out of the page cache."""
    eng = c.llm.engine
    manager = eng.kv_worker.manager
    if not manager.flush(60):
        raise RuntimeError(f"{c.name}: tier writes not flushed within 60 s")
    keys = prefix_keys(c.llm, prefix)
    held = manager.tiers[c.name].contains_prefix(keys)
    if held != len(keys):
        raise RuntimeError(f"{c.name}: the tier holds {held} of the prefix's {len(keys)} blocks")
    eng.pool.reset_prefix_cache()
    if c.name == "disk":
        drop_page_cache(Path(manager.tiers["disk"].root))


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to drop these files' cached pages, so a disk hit reads the disk, not
    memory. Only clean pages go: fsync first (the tier fsyncs each write already; this is
    cheap then). Needs no privileges, unlike drop_caches."""
    for path in root.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(c: Condition, rid: str, prompt: list[int], salt: str | None = None) -> Sample:
    """One request, with the bytes its tier read (the tier's counters before and after)."""
    manager = c.llm.engine.kv_worker.manager if c.llm.engine.kv_worker.manager else None
    before = manager.stats()[c.name].bytes_loaded if manager else 0
    out = run_one(c.llm, rid, prompt, salt)
    after = manager.stats()[c.name].bytes_loaded if manager else 0
    m = out.metrics
    return Sample(m["first_token"] - m["arrival"], m["scheduled"] - m["arrival"],
                  out.num_cached_tokens, after - before, out.outputs[0].token_ids[0],
                  _policy(out))


def _policy(out) -> str | None:
    decision = getattr(out, "kv_decision", None)  # engines without a tier policy have none
    return None if decision is None else decision.header()


def measure(c: Condition, rep: int, prompt: list[int], prefix: list[int], hit: int) -> Sample:
    """One repetition of a condition; checks the hit is the one the condition claims."""
    if c.name in TIERS:
        prepare_tier(c, prefix)
    salt = f"cold-{rep}-{uuid.uuid4().hex[:6]}" if c.name == "cold" else None
    s = timed(c, f"{c.name}-{rep}", prompt, salt)
    want = 0 if c.name == "cold" else hit
    if s.cached_tokens != want:
        tier = c.llm.engine.kv_worker.manager.stats()[c.name] if c.name in TIERS else None
        raise RuntimeError(f"{c.name} repetition {rep}: {s.cached_tokens} cached tokens, "
                           f"expected {want}; tier policy: {s.policy}; tier counters: {tier}")
    if c.name in TIERS:
        layout = c.llm.engine.kv_worker.manager.layout
        if s.bytes_loaded != hit // layout.block_size * layout.block_bytes:
            raise RuntimeError(f"{c.name} repetition {rep}: the tier read {s.bytes_loaded} "
                               f"bytes, not the whole prefix's")
    return s


def warm(c: Condition, prefix: list[int], prompt: list[int]) -> None:
    """Put the prefix where the condition needs it and pay the one-time costs untimed."""
    run_one(c.llm, f"{c.name}-store", prompt)
    if c.name in TIERS:
        prepare_tier(c, prefix)
        run_one(c.llm, f"{c.name}-warm-hit", prompt)


# ---- the run -------------------------------------------------------------------------------------

def run(args, tmp: Path, endpoint: str) -> tuple[dict[str, Condition], dict]:
    base = make_llm(args, args.prefix_tokens)
    corpus = corpus_ids(base, args.prefix_tokens + args.repeat + 1 + SUFFIX_TOKENS)
    prefix, reps = prompts(corpus, args.prefix_tokens, args.repeat + 1)
    warm_prompt, reps = reps[-1], reps[:-1]
    hit = args.prefix_tokens // base.engine.pool.block_size * base.engine.pool.block_size
    conds = {"cold": Condition("cold", base), "device": Condition("device", base)}
    for name in TIERS:
        log(f"engine with the {name} tier")
        conds[name] = Condition(name, make_llm(args, args.prefix_tokens,
                                               tier_config(name, tmp, endpoint)))
    try:
        for c in conds.values():
            if c.name != "cold":  # cold shares the device engine, warmed there
                log(f"warming {c.name}: store the prefix, one untimed hit")
                warm(c, prefix, warm_prompt)
        for rep, prompt in enumerate(reps):
            for c in conds.values():
                c.samples.append(measure(c, rep, prompt, prefix, hit))
                log(f"  repetition {rep + 1}/{args.repeat} {c.name:6s} "
                    f"{c.samples[-1].ttft_s * 1e3:8.1f} ms")
    finally:
        for c in conds.values():
            c.llm.engine.close()  # stops tier threads; nothing to stop without tiers
    eng = base.engine
    meta = {"threads": eng.num_threads, "hit_tokens": hit,
            "kv_cache_dtype": kv_dtype_name(base),
            "block_bytes": conds["cpu"].llm.engine.kv_worker.manager.layout.block_bytes}
    return conds, meta


def summarize(conds: dict[str, Condition]) -> dict[str, dict]:
    cold = statistics.median(s.ttft_s for s in conds["cold"].samples)
    cold_tokens = [s.first_token for s in conds["cold"].samples]
    out = {}
    for name, c in conds.items():
        t = [s.ttft_s for s in c.samples]
        med = statistics.median(t)
        target = TARGETS.get(name)
        out[name] = {
            "ttft_ms": [x * 1e3 for x in t], "median_ms": med * 1e3, "min_ms": min(t) * 1e3,
            "max_ms": max(t) * 1e3, "ratio_to_cold": med / cold,
            "wait_median_ms": statistics.median(s.wait_s for s in c.samples) * 1e3,
            "bytes_loaded": [s.bytes_loaded for s in c.samples],
            "cached_tokens": [s.cached_tokens for s in c.samples],
            "policy": [s.policy for s in c.samples],
            "first_token_as_cold": sum(s.first_token == f
                                       for s, f in zip(c.samples, cold_tokens)),
            "target_ratio": target, "holds": None if target is None else med / cold <= target}
    return out



def print_table(summary: dict[str, dict], meta: dict, args) -> None:
    n = args.repeat
    print(f"\n## time to first token, {args.prefix_tokens}-token prefix ({meta['hit_tokens']} "
          f"tokens hit), {n} repetitions, {meta['threads']} threads, KV {meta['kv_cache_dtype']}\n")
    print(markdown_table(
        ("condition", "median TTFT (ms)", "min", "max", "x cold", "of which load (ms)",
         "MB loaded / request", "cached tokens", "first token = cold's", "target", "holds"),
        "lrrrrrrrrll", (table_row(name, r, n) for name, r in summary.items())))
    ok = all(r["holds"] for r in summary.values() if r["holds"] is not None)
    print("\n'of which load': median time from arrival to the first model step that computes the "
          "request (tier lookup, read, copy into the device cache); the rest is that step.")
    print(f"\ntargets: {'all hold' if ok else 'NOT all hold'} "
          f"(load average {meta['loadavg_start']:.2f} at start, {meta['loadavg_end']:.2f} at end)")


def table_row(name: str, r: dict, n: int) -> list[str]:
    target = "-" if r["target_ratio"] is None else f"<= {r['target_ratio']:.2f}x"
    holds = "-" if r["holds"] is None else ("**yes**" if r["holds"] else "**NO**")
    return [name, f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}", f"{r['max_ms']:.1f}",
            f"{r['ratio_to_cold']:.3f}", f"{r['wait_median_ms']:.1f}",
            f"{statistics.median(r['bytes_loaded']) / 1e6:.1f}",
            f"{statistics.median(r['cached_tokens']):.0f}", f"{r['first_token_as_cold']}/{n}",
            target, holds]


def plot(summary: dict[str, dict], path: str, title: str) -> None:
    plt = pyplot()
    names = list(summary)
    med = [summary[n]["median_ms"] for n in names]
    lo = [m - summary[n]["min_ms"] for n, m in zip(names, med)]
    hi = [summary[n]["max_ms"] - m for n, m in zip(names, med)]
    colors = {"cold": "tab:gray", "device": "tab:green", "cpu": "tab:blue", "disk": "tab:orange",
              "s3": "tab:purple"}
    labels = [n + (f"\n{statistics.median(summary[n]['bytes_loaded']) / 1e6:.0f} MB read"
                   if n in TIERS else "") for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=[colors.get(n, "tab:blue") for n in names])
    for i, n in enumerate(names):  # above the whisker, so the two never overlap
        ax.annotate(f"{med[i]:.0f} ms", (i, summary[n]["max_ms"]), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=9)
    cold = summary["cold"]["median_ms"]
    for ratio, style in ((1 / 5, "--"), (1 / 2, ":")):
        xs = [i for i, n in enumerate(names) if TARGETS.get(n) == ratio]
        if xs:
            ax.hlines(cold * ratio, min(xs) - 0.45, max(xs) + 0.45, colors="red", linestyles=style,
                      label=f"target {', '.join(names[i] for i in xs)}: cold / {round(1 / ratio)}")
    ax.set_yscale("log")
    ax.set_ylim(top=max(summary[n]["max_ms"] for n in names) * 3)
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title + "\nbars: median, whiskers: min to max", fontsize=10)
    ax.legend(loc="upper right")
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    """This script's flags, and (for the old `--slo` command lines) bench/tiers_slo.py's."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed requests per condition")
    add_common_args(ap)
    ap.add_argument("--slo", action="store_true",
                    help="run bench/tiers_slo.py instead (the tier policy under a slow S3), "
                         "with the --slo-* flags below")
    tiers_slo.add_slo_args(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.slo:  # the demo's own script now; the old command lines run it as before
        tiers_slo.run_main(args)
        return
    conds, meta = with_seaweed("tierserve-bench-", lambda tmp, url: run(args, tmp, url))
    summary = summarize(conds)
    print_table(summary, meta, args)
    title = (f"TTFT, {args.prefix_tokens}-token prefix, median of {args.repeat}, "
             f"{meta['threads']} threads, KV {meta['kv_cache_dtype']}")
    save_outputs(args.json, lambda: {"conditions": summary, **meta, "args": vars(args)},
                 args.plot, lambda path: plot(summary, path, title))


if __name__ == "__main__":
    main(sys.argv[1:])
