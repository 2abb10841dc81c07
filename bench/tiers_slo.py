"""The tier policy under a slow S3: interactive and batch requests, TTFT per class.

    python bench/tiers_slo.py --json bench/out/tiers_slo.json --plot docs/tiers_slo.png
    python bench/tiers_slo.py --prefix-tokens 64 --slo-suffix-tokens 16 --slo-interactive 1 \\
        --slo-batch 1 --slo-cold-checks 1 --slo-delay-ms 50    # a quick check that it runs

(`python bench/tiers.py --slo ...` runs this script too, with the same flags: the demo was a mode
of that script before it had one of its own.)

One engine per mode with the cpu, disk and s3 tiers, S3 behind tests/delay_proxy.py adding
--slo-delay-ms to every HTTP request. A sequence of interactive requests (TTFT budget
--slo-budget-ms) and batch requests spread evenly through it, each the shared prefix plus a chat
turn of its own (--slo-suffix-tokens of distinct text: its blocks are in no tier), device prefix
cache reset before each (a replica that lacks the prefix). Each request runs in both modes, the
two taking turns going first:

    mode    interactive hints                         batch hints
    ------  ----------------------------------------  -------------------------------------
    policy  slo_class interactive, ttft_budget_ms     slo_class batch
    forced  load and store tiers cpu,disk,s3 (explicit: no cost model, no budget), the class

Warm-up, the same for both engines: the start-up probe runs with the delay on; then, with the
delay off (S3 writes of 125 blocks would take a minute at 2 round trips each), a request stores
the prefix to every tier and the writes are flushed; then, delay on, one untimed hit from each
tier alone, so the cost model has measured every tier before the timed requests. Each request's
first token is checked against a reference engine without tiers (the prefix in its device cache;
--slo-cold-checks of those references are checked against a fully cold run first).

Target (the tier-policy issue): interactive requests meet their budget at p99 with the policy on.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

# tiers_common first: it puts the checkout and tests/ (s3_fixtures, delay_proxy) on sys.path
from tiers_common import (TIERS, add_common_args, corpus_ids, kv_dtype_name, log, make_llm,
                          prefix_keys, run_one, with_seaweed)
from tables import markdown_table, pyplot, save_figure, save_outputs
from delay_proxy import delay_proxy
from s3_fixtures import BUCKET
from tierserve import LLM, KVHints, SloClass
from tierserve.engine.kv_tiers.config import TierConfig

SLO_MODES = ("policy", "forced")
"""policy: the engine's tier policy decides from class and budget; forced: every tier named."""
SLO_CLASSES = ("interactive", "batch")
CACHES = ("device", *TIERS)


@dataclass
class SloSample:
    """One timed request of the --slo run."""

    index: int
    """Position in the request sequence (the same prompt in both modes)."""
    mode: str
    cls: str
    ttft_s: float
    wait_s: float
    """Arrival until the first step that computes it: policy, tier lookup, read, copy in."""
    hit_tokens: dict[str, int]
    """Prompt tokens served per cache (device, cpu, disk, s3): the engine's kv_hit_tokens."""
    s3_asked: bool
    """The lookup sent S3 HEAD requests (the s3 tier's lookup counter moved)."""
    first_token: int
    reference: int
    """First token of the engine without tiers for the same prompt."""
    load_tiers: tuple[str, ...]
    skipped: dict[str, str]
    """Tier -> why the policy did not load from it ('budget', 'cost', 'short prompt', 'hint')."""
    policy: str | None


def slo_classes(n_interactive: int, n_batch: int) -> list[str]:
    """The class of each request in order, batch requests spread evenly (12 + 6: I I B ...)."""
    n = n_interactive + n_batch
    return ["batch" if (i + 1) * n_batch // n > i * n_batch // n else "interactive"
            for i in range(n)]


def slo_prompts(corpus: list[int], prefix_len: int, suffix_len: int,
                n: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and n prompts, each adding the next `suffix_len` tokens of the text
    after it (distinct text per prompt, so no tier holds any block past the prefix)."""
    prefix = corpus[:prefix_len]
    return prefix, [prefix + corpus[prefix_len + i * suffix_len:prefix_len + (i + 1) * suffix_len]
                    for i in range(n)]


def slo_hints(mode: str, cls: str, budget_ms: float) -> KVHints:
    slo = SloClass.INTERACTIVE if cls == "interactive" else SloClass.BATCH
    if mode == "forced":
        return KVHints(load_tiers=TIERS, store_tiers=TIERS, slo_class=slo)
    return KVHints(slo_class=slo, ttft_budget_ms=budget_ms if cls == "interactive" else None)


def slo_tier_config(tmp: Path, s3_url: str, mode: str) -> TierConfig:
    """cpu, disk and s3 (through the proxy), each engine under its own disk folder and S3
    prefix: a tail one mode stored is never a hit for the other."""
    return TierConfig(tiers=TIERS, cpu_bytes=4 << 30, disk_dir=str(tmp / f"kv-disk-{mode}"),
                      disk_bytes=4 << 30, s3_bucket=BUCKET, s3_endpoint_url=s3_url,
                      s3_region="us-east-1", s3_prefix=f"slo-{mode}-{uuid.uuid4().hex[:8]}",
                      s3_read_timeout_s=10.0)


def reference_tokens(llm: LLM, prompts: list[list[int]], args) -> tuple[list[int], int]:
    """First token of each prompt from an engine without tiers, the prefix in its device cache;
    the first `--slo-cold-checks` of them also from a cold run (a salt of its own), which must
    agree. Returns the tokens and how many cold runs agreed."""
    run_one(llm, "ref-store", prompts[-1])
    refs = [run_one(llm, f"ref-{i}", p).outputs[0].token_ids[0] for i, p in enumerate(prompts)]
    agreed = 0
    for i in range(min(args.slo_cold_checks, len(prompts))):
        cold = run_one(llm, f"ref-cold-{i}", prompts[i], salt=f"cold-{uuid.uuid4().hex[:6]}")
        agreed += cold.outputs[0].token_ids[0] == refs[i]
        log(f"  cold check {i + 1}/{args.slo_cold_checks}: TTFT "
            f"{(cold.metrics['first_token'] - cold.metrics['arrival']) * 1e3:.0f} ms, "
            f"token {'agrees' if agreed == i + 1 else 'DIFFERS'}")
    return refs, agreed


def wait_for_probe(llm: LLM, timeout: float = 60.0) -> None:
    """The engine's start-up probe has measured every tier's lookup (it runs in the background)."""
    cost = llm.engine.kv.cost
    end = time.monotonic() + timeout
    while set(cost.snapshot()["lookup_s"]) != set(TIERS):
        if time.monotonic() > end:
            raise RuntimeError(f"the tier probe did not finish in {timeout:.0f} s")
        time.sleep(0.05)


def slo_store(llm: LLM, prompt: list[int], prefix: list[int]) -> None:
    """One request computes the prefix and stores it to every tier; the writes are flushed."""
    run_one(llm, "slo-store", prompt, hints=KVHints(load_tiers=(), store_tiers=TIERS))
    manager = llm.engine.kv_worker.manager
    if not manager.flush(120):
        raise RuntimeError("tier writes not flushed within 120 s")
    keys = prefix_keys(llm, prefix)
    for name, tier in manager.tiers.items():
        if tier.contains_prefix(keys) != len(keys):
            raise RuntimeError(f"the {name} tier lacks part of the prefix after the flush")


def slo_warm_hits(llm: LLM, prompt: list[int], hit: int) -> None:
    """One untimed hit from each tier alone (device reset first): the cost model's first loads."""
    for name in TIERS:
        llm.engine.pool.reset_prefix_cache()
        out = run_one(llm, f"slo-warm-{name}", prompt,
                      hints=KVHints(load_tiers=(name,), store_tiers=()))
        got = out.kv_hit_tokens.get(name, 0)
        log(f"  warm hit from {name}: {got} tokens, "
            f"{(out.metrics['first_token'] - out.metrics['arrival']) * 1e3:.0f} ms")
        if got < hit:
            raise RuntimeError(f"warm hit from {name}: {got} tokens, expected {hit}")


def slo_timed(llm: LLM, mode: str, index: int, cls: str, prompt: list[int], reference: int,
              args) -> SloSample:
    eng = llm.engine
    eng.pool.reset_prefix_cache()  # a replica whose device cache lacks the prefix
    lookups = eng.kv_worker.manager.stats()["s3"].lookups
    out = run_one(llm, f"slo-{mode}-{index}", prompt,
                  hints=slo_hints(mode, cls, args.slo_budget_ms))
    m, d = out.metrics, out.kv_decision
    return SloSample(index, mode, cls, m["first_token"] - m["arrival"],
                     m["scheduled"] - m["arrival"], dict(out.kv_hit_tokens),
                     eng.kv_worker.manager.stats()["s3"].lookups > lookups,
                     out.outputs[0].token_ids[0], reference, d.load_tiers, dict(d.skipped),
                     d.header())


def run_slo(args, tmp: Path, endpoint: str) -> tuple[list[SloSample], dict]:
    classes = slo_classes(args.slo_interactive, args.slo_batch)
    with delay_proxy(endpoint, args.slo_delay_ms / 1e3) as proxy:
        log("reference engine (no tiers): first tokens")
        ref = make_llm(args, args.prefix_tokens, suffix_len=args.slo_suffix_tokens)
        corpus = corpus_ids(ref, args.prefix_tokens + (len(classes) + 1) * args.slo_suffix_tokens)
        prefix, prompts = slo_prompts(corpus, args.prefix_tokens, args.slo_suffix_tokens,
                                      len(classes) + 1)
        refs, agreed = reference_tokens(ref, prompts, args)
        del ref  # its KV cache and weights: the two engines below need the memory more
        engines = {}
        for mode in SLO_MODES:
            log(f"engine for mode {mode}: cpu, disk, s3 via the proxy; probe with the delay on")
            engines[mode] = make_llm(args, args.prefix_tokens,
                                     slo_tier_config(tmp, proxy.url, mode), args.slo_suffix_tokens)
            wait_for_probe(engines[mode])
        bs = engines["policy"].engine.pool.block_size
        hit = args.prefix_tokens // bs * bs
        try:
            slo_warm(engines, proxy, prompts[-1], prefix, hit, args)
            cost_before = {m: llm.engine.kv.cost.snapshot() for m, llm in engines.items()}
            samples = slo_sequence(engines, classes, prompts[:-1], refs, args)
            meta = {"cost_model_before": cost_before,
                    "cost_model_after": {m: llm.engine.kv.cost.snapshot()
                                         for m, llm in engines.items()},
                    "policy_counters": {m: asdict(llm.engine.kv.counters)
                                        for m, llm in engines.items()},
                    "proxy_requests": proxy.requests}
        finally:
            for llm in engines.values():
                llm.engine.close()
    eng = engines["policy"].engine
    meta.update(threads=eng.num_threads, hit_tokens=hit, cold_checks=args.slo_cold_checks,
                cold_checks_agreed=agreed, kv_cache_dtype=kv_dtype_name(engines["policy"]))
    return samples, meta


def slo_warm(engines: dict[str, LLM], proxy, prompt: list[int], prefix: list[int], hit: int,
             args) -> None:
    """Each engine stores the prefix to every tier with the proxy's delay off, then (delay back
    on) takes one untimed hit from each tier: the cost model has measured every tier."""
    delay, proxy.delay_s = proxy.delay_s, 0.0
    for mode, llm in engines.items():
        log(f"warming {mode}: store the prefix to every tier (delay off), flush")
        slo_store(llm, prompt, prefix)
    proxy.delay_s = delay
    for mode, llm in engines.items():
        log(f"warming {mode}: one untimed hit per tier ({args.slo_delay_ms:.0f} ms delay)")
        slo_warm_hits(llm, prompt, hit)


def slo_sequence(engines: dict[str, LLM], classes: list[str], prompts: list[list[int]],
                 refs: list[int], args) -> list[SloSample]:
    """Each request in both modes, the modes taking turns going first (a machine that slows
    down mid-run slows both alike). Before each, both engines' tier writes are flushed: the
    engines share two cores, and one's background writes (disk fsyncs, S3 uploads through the
    weed process) would slow the other's timed step. A request's own writes start after its
    first token, so they are never inside its TTFT."""
    samples = []
    for i, (cls, prompt) in enumerate(zip(classes, prompts)):
        order = SLO_MODES if i % 2 == 0 else SLO_MODES[::-1]
        for mode in order:
            for llm in engines.values():
                if not llm.engine.kv_worker.manager.flush(60):
                    raise RuntimeError("tier writes not flushed within 60 s")
            s = slo_timed(engines[mode], mode, i, cls, prompt, refs[i], args)
            samples.append(s)
            log(f"  {i + 1:2d}/{len(classes)} {cls:11s} {mode:6s} {s.ttft_s * 1e3:7.1f} ms  "
                f"{s.policy}")
    return samples


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank: with fewer than 100 values, p99 is the maximum."""
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def summarize_slo(samples: list[SloSample], budget_ms: float) -> dict[str, dict]:
    out = {}
    for mode in SLO_MODES:
        for cls in SLO_CLASSES:
            group = [s for s in samples if s.mode == mode and s.cls == cls]
            if group:
                out[f"{mode}/{cls}"] = summarize_group(group, budget_ms)
    return out


def summarize_group(group: list[SloSample], budget_ms: float) -> dict:
    t = [s.ttft_s * 1e3 for s in group]
    return {
        "mode": group[0].mode, "cls": group[0].cls, "n": len(group), "ttft_ms": t,
        "p50_ms": statistics.median(t), "p99_ms": nearest_rank(t, 0.99),
        "mean_ms": statistics.fmean(t), "max_ms": max(t),
        "wait_p50_ms": statistics.median(s.wait_s * 1e3 for s in group),
        "within_budget": sum(x <= budget_ms for x in t),
        "hit_tokens_median": {c: statistics.median(s.hit_tokens.get(c, 0) for s in group)
                              for c in CACHES},
        "s3_asked": sum(s.s3_asked for s in group),
        "first_token_as_reference": sum(s.first_token == s.reference for s in group),
        "load_tiers": dict(Counter(",".join(s.load_tiers) or "none" for s in group)),
        "skipped": dict(Counter(f"{k}: {v}" for s in group for k, v in s.skipped.items()))}


def print_slo_table(summary: dict[str, dict], meta: dict, args) -> None:
    print(f"\n## TTFT per class, S3 +{args.slo_delay_ms:.0f} ms per request, "
          f"{args.prefix_tokens}-token shared prefix + {args.slo_suffix_tokens}-token turn, "
          f"{meta['threads']} threads, KV {meta['kv_cache_dtype']}\n")
    print(markdown_table(
        ("mode", "class", "requests", "TTFT p50 (ms)", "p99", "mean", "of which load p50",
         f"within {args.slo_budget_ms:.0f} ms", "median tokens device / cpu / disk / s3",
         "S3 looked up", "first token = reference"),
        "llrrrrrrlrr", (slo_row(r) for r in summary.values())))
    print_slo_notes(summary, meta, args)


def slo_row(r: dict) -> list[str]:
    toks = " / ".join(f"{r['hit_tokens_median'][c]:.0f}" for c in CACHES)
    within = f"{r['within_budget']}/{r['n']}" if r["cls"] == "interactive" else "-"
    return [r["mode"], r["cls"], str(r["n"]), f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}",
            f"{r['mean_ms']:.0f}", f"{r['wait_p50_ms']:.0f}", within, toks,
            f"{r['s3_asked']}/{r['n']}", f"{r['first_token_as_reference']}/{r['n']}"]


def print_slo_notes(summary: dict[str, dict], meta: dict, args) -> None:
    print("\np99 is by nearest rank: with fewer than 100 requests per class it is the slowest one. "
          "'of which load': arrival to the first step that computes the request (policy, tier "
          "lookup, read, copy into the device cache).")
    for key, r in summary.items():
        skipped = ", ".join(f"{k} x{n}" for k, n in r["skipped"].items()) or "none"
        loads = ", ".join(f"{k} x{n}" for k, n in r["load_tiers"].items())
        print(f"- {key}: loads from {loads}; skipped {skipped}")
    print(f"- reference first tokens: engine without tiers, prefix in its device cache; "
          f"{meta['cold_checks_agreed']}/{meta['cold_checks']} agreed with a fully cold run")
    r = summary.get("policy/interactive")
    ok = r is not None and r["p99_ms"] <= args.slo_budget_ms
    print(f"\ntarget (interactive p99 <= {args.slo_budget_ms:.0f} ms with the policy on): "
          f"{'**holds**' if ok else '**does NOT hold**'} (load average "
          f"{meta['loadavg_start']:.2f} at start, {meta['loadavg_end']:.2f} at end)")


def plot_slo(summary: dict[str, dict], path: str, budget_ms: float, title: str) -> None:
    plt = pyplot()
    keys = list(summary)
    xs = range(len(keys))
    colors = {"policy": "tab:blue", "forced": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for off, stat, alpha in ((-0.2, "p50_ms", 1.0), (0.2, "p99_ms", 0.5)):
        bars = ax.bar([x + off for x in xs], [summary[k][stat] for k in keys], width=0.38,
                      alpha=alpha, color=[colors[summary[k]["mode"]] for k in keys])
        for bar, k in zip(bars, keys):
            ax.annotate(f"{stat[:3]}\n{summary[k][stat]:.0f}", (bar.get_x() + 0.19,
                        bar.get_height()), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8)
    for x, k in zip(xs, keys):  # every request, so a lone slow one shows
        ax.plot([x] * summary[k]["n"], summary[k]["ttft_ms"], "k.", markersize=4, zorder=3)
    ax.axhline(budget_ms, color="red", linestyle="--",
               label=f"interactive budget {budget_ms:.0f} ms")
    ax.set_xticks(list(xs), [k.replace("/", "\n") for k in keys])
    ax.set_ylim(top=max(summary[k]["max_ms"] for k in keys) * 1.25)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title + "\nbars: p50 (solid), p99 (light); dots: each request", fontsize=10)
    ax.legend(loc="upper left")
    save_figure(fig, path)



def add_slo_args(ap: argparse.ArgumentParser) -> None:
    """The --slo-* flags (bench/tiers.py adds them too, for its old `--slo` command lines)."""
    ap.add_argument("--slo-delay-ms", type=float, default=300.0,
                    help="delay the proxy adds to each S3 request")
    ap.add_argument("--slo-budget-ms", type=float, default=500.0,
                    help="TTFT budget of the interactive requests")
    ap.add_argument("--slo-interactive", type=int, default=12, help="interactive requests")
    ap.add_argument("--slo-batch", type=int, default=6, help="batch requests")
    ap.add_argument("--slo-suffix-tokens", type=int, default=64,
                    help="tokens of each request's own turn after the shared prefix")
    ap.add_argument("--slo-cold-checks", type=int, default=2,
                    help="reference first tokens checked against a fully cold run")


def run_main(args) -> None:
    """The whole demo for parsed flags (add_common_args and add_slo_args)."""
    samples, meta = with_seaweed("tierserve-bench-slo-",
                                 lambda tmp, url: run_slo(args, tmp, url))
    summary = summarize_slo(samples, args.slo_budget_ms)
    print_slo_table(summary, meta, args)
    title = (f"TTFT per class, S3 +{args.slo_delay_ms:.0f} ms/request, "
             f"{args.prefix_tokens}+{args.slo_suffix_tokens} tokens, {meta['threads']} threads")
    save_outputs(args.json, lambda: {"summary": summary, "samples": [asdict(s) for s in samples],
                                     **meta, "args": vars(args)},
                 args.plot, lambda path: plot_slo(summary, path, args.slo_budget_ms, title))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    add_slo_args(ap)
    run_main(ap.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
