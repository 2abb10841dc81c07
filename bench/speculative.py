"""Speculative decoding against none, in one run on this box: decode speed and acceptance.

    python bench/speculative.py                   # ngram k=4 against none; minutes on 2 cores
    python bench/speculative.py --spec '{"method": "draft_model", "model": "smollm2-135m",
        "num_speculative_tokens": 3}' --spec '{"method": "ngram", "num_speculative_tokens": 4}'
    python bench/speculative.py --quick           # a smoke test: tiny sizes, well under a minute

Workloads (shipped text only; chat prompts, greedy, max_tokens 128):
- copy: "Repeat the following text exactly, word for word" over a passage of
  tests/data/long_text.md (150-300 words, each request its own): what prompt lookup is for.
- nocopy: open-ended writing ("Write a short story about ...") with no source text to copy.

At 1 stream the requests run one at a time and the median inter-token latency counts
((last token - first token) / (tokens - 1): prefill excluded); at N streams (--streams) N requests
go in one generate call and its output tokens/s counts. Each config is one engine, built once and
warmed up; the engines take turns at each workload and stream count, each timed call starting
from an empty prefix cache. Speculative rows add the acceptance rate (accepted / proposed tokens),
the accepted tokens per draft (one request's proposals verified in one step), the engine steps,
and the ratio to none (none's ITL / this ITL, this tok/s / none's tok/s: over 1 is faster).
Greedy outputs are compared with none's; a request that differs gives a warning line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import shlex
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.tables import cpu_name, markdown_table, pyplot, save_figure, save_outputs  # noqa: E402
from tierserve.engine import LLM, SamplingParams  # noqa: E402
from tierserve.engine.config import parse_bytes  # noqa: E402
from tierserve.engine.spec.config import SpeculativeConfig  # noqa: E402

TEXT = os.path.join(ROOT, "tests", "data", "long_text.md")
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
         '"prompt_lookup_max": 5}')
TOPICS = ("a lighthouse keeper", "a lost robot", "the first snow of winter", "a city under the sea",
          "an old violin", "a dragon who cannot fly", "a night train", "a garden on Mars")
TASKS = ("Write a short story about {}.", "Write a poem about {}.",
         "Describe {} to a ten-year-old.", "Write a news report about {}.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- workloads: n user messages each -------------------------------------------------------------

def copy_messages(n: int, lo: int = 150, hi: int = 300) -> list[str]:
    """Passages of lo..hi words, each from a different paragraph on (so two prompts share no
    more than the instruction), repeated in turn when n asks for more."""
    paras = open(TEXT).read().split("\n\n")
    found = []
    for i in range(len(paras)):
        j, words = i, 0
        while words < lo and j < len(paras):
            words, j = words + len(paras[j].split()), j + 1
        if lo <= words <= hi:
            found.append("Repeat the following text exactly, word for word:\n\n"
                         + "\n\n".join(paras[i:j]))
    return [found[i % len(found)] for i in range(n)]


def nocopy_messages(n: int) -> list[str]:
    found = [task.format(topic) for task in TASKS for topic in TOPICS]
    return [found[i % len(found)] for i in range(n)]


WORKLOADS = {"copy": copy_messages, "nocopy": nocopy_messages}


def chat_prompts(llm: LLM, workload: str, n: int) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": m}])
            for m in WORKLOADS[workload](n)]


# ---- one timed call ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    value: float
    """1 stream: the median inter-token latency in ms; more: output tokens/s of the call."""
    tokens: list[list[int]]
    """Each request's output token ids, in prompt order."""
    drafts: int
    draft_tokens: int
    accepted: int
    steps: int
    """Engine steps the run took."""


def itl_ms(out) -> float | None:
    n, m = len(out.outputs[0].token_ids), out.metrics
    return (m["last_token"] - m["first_token"]) / (n - 1) * 1e3 if n > 1 else None


def timed(llm: LLM, prompts: list[str], params: SamplingParams, streams: int) -> Run:
    eng = llm.engine
    eng.pool.reset_prefix_cache()  # every config prefills every prompt
    before, steps = eng.spec_stats(), eng.stats.steps
    if streams == 1:
        outs = [llm.generate(p, params)[0] for p in prompts]
        value = statistics.median([x for x in map(itl_ms, outs) if x is not None] or [float("nan")])
    else:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        value = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    after = eng.spec_stats()
    return Run(value, [list(o.outputs[0].token_ids) for o in outs],
               after.num_drafts - before.num_drafts,
               after.num_draft_tokens - before.num_draft_tokens,
               after.num_accepted_tokens - before.num_accepted_tokens, eng.stats.steps - steps)


def speed_up(run: Run, base: Run, streams: int) -> float:
    """Over 1 is faster: a shorter ITL at one stream, more tok/s at several."""
    return base.value / run.value if streams == 1 else run.value / base.value


def same_as(run: Run, base: Run) -> int:
    return sum(a == b for a, b in zip(run.tokens, base.tokens))


# ---- output --------------------------------------------------------------------------------------

def table(results: dict, workloads: list[str], streams: int, configs: list[str]) -> str:
    rows = []
    for w in workloads:
        base = results[w, streams, "none"]
        for name in configs:
            r = results[w, streams, name]
            spec = name != "none"
            rows.append([w, name, f"{r.value:.1f}" if streams == 1 else f"{r.value:.0f}",
                         f"{speed_up(r, base, streams):.2f}x" if spec else "",
                         f"{r.accepted / r.draft_tokens:.0%}" if r.draft_tokens else "",
                         f"{r.accepted / r.drafts:.2f}" if r.drafts else "", r.steps,
                         f"{same_as(r, base)}/{len(base.tokens)}" if spec else ""])
    metric = "median ITL ms" if streams == 1 else "output tok/s"
    return markdown_table(["workload", "config", metric, "vs none", "acceptance",
                           "accepted / draft", "engine steps", "greedy = none"], "llrrrrrr", rows)


def plot(results: dict, groups: list[tuple[str, int]], specs: list[str], title: str,
         path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * len(specs)), 4))
    width = 0.8 / len(specs)
    for i, name in enumerate(specs):
        ys = [speed_up(results[w, s, name], results[w, s, "none"], s) for w, s in groups]
        ax.bar([g - 0.4 + (i + 0.5) * width for g in range(len(groups))], ys, width, label=name)
    ax.axhline(1, color="gray", ls="--")
    ax.set_xticks(range(len(groups)),
                  [f"{w}\n{s} stream, ITL" if s == 1 else f"{w}\n{s} streams, tok/s"
                   for w, s in groups])
    ax.set_ylabel("speed-up against none (over 1: faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=6, help="requests at 1 stream")
    ap.add_argument("--streams", type=int, default=32, help="requests in the one batched call")
    ap.add_argument("--workloads", default="copy,nocopy", help=", ".join(WORKLOADS))
    ap.add_argument("--spec", action="append", default=None,
                    help=f"a speculative_config (JSON); repeat for several (default {NGRAM})")
    ap.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=2 << 30,
                    help="each engine's KV cache (a draft model's KV takes its share)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "out", "speculative.png"),
                    help="write a PNG bar chart of the speed-ups here ('' for none)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 16 tokens, 2 requests, 4 streams, 256 MiB KV caches")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.requests, args.streams = 16, 2, 4
        args.kv_cache_memory_bytes = 1 << 28
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workload {sorted(unknown)[0]!r}; workloads: {', '.join(WORKLOADS)}")
    specs = {SpeculativeConfig.parse(s).describe(): s for s in args.spec or [NGRAM]}
    configs = ["none", *specs]

    llms = {}
    for name in configs:
        t = time.perf_counter()
        llms[name] = LLM(model=args.model, quantization=args.quantization,
                         speculative_config=specs.get(name),
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                         max_num_seqs=max(64, args.streams))
        # Warm-up: first-use allocations, the native build, and a draft or two to verify.
        llms[name].generate(chat_prompts(llms[name], "copy", 1),
                            SamplingParams(temperature=0, max_tokens=8))
        log(f"{name}: loaded and warmed up in {time.perf_counter() - t:.1f} s")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    groups = [(w, s) for w in workloads for s in (1, args.streams)]
    results, warnings = {}, []
    for w, streams in groups:
        prompts = chat_prompts(llms["none"], w, args.requests if streams == 1 else streams)
        for name in configs:  # the engines take turns at each workload and stream count
            r = results[w, streams, name] = timed(llms[name], prompts, params, streams)
            unit = "ms ITL (median)" if streams == 1 else "output tok/s"
            log(f"{w}, {streams} stream(s), {name}: {r.value:.1f} {unit}, "
                f"{sum(map(len, r.tokens))} tokens, {r.steps} steps, "
                f"{r.accepted}/{r.draft_tokens} draft tokens accepted")
            base = results[w, streams, "none"]
            if same_as(r, base) < len(base.tokens):
                warnings.append(f"warning: {w}, {streams} stream(s), {name}: greedy output differs "
                                f"from none's in {len(base.tokens) - same_as(r, base)} of "
                                f"{len(base.tokens)} requests")
                log(warnings[-1])

    title = f"{cpu_name()}, {os.cpu_count()} cores; {args.model}, quantization {args.quantization}"
    print(f"\n{title}\n\n    " + shlex.join(["python", "bench/speculative.py"] + sys.argv[1:]) + "\n")
    for streams in (1, args.streams):
        print(f"## {streams} stream{'s' if streams > 1 else ''}, max_tokens {args.max_tokens}"
              + (f" ({args.requests} requests one at a time)\n" if streams == 1 else "\n"))
        print(table(results, workloads, streams, configs) + "\n")
    for line in warnings:
        print(line)
    save_outputs(args.json, lambda: {
        "title": title, "args": vars(args),
        "runs": [{"workload": w, "streams": s, "config": name, **vars(r)}
                 for (w, s, name), r in results.items()]},
        args.plot, lambda path: plot(results, groups, list(specs), title, path))


if __name__ == "__main__":
    main()
