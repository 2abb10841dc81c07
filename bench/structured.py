"""Structured outputs: throughput against free decoding, the mask's share of the step, compiles.

    .venv/bin/python bench/structured.py                       # 3 rounds, ~2 min on 2 cores
    .venv/bin/python bench/structured.py --rounds 5 --json bench/out/structured.json

1. Throughput: one `tierserve serve` (embedded smollm2-135m, --max-num-seqs 32, KV tiers off),
   turns of 32 concurrent chat requests through the `openai` AsyncOpenAI client, all constrained
   by a JSON schema (response_format json_schema) or all free; temperature 0. The schema's outputs
   have a near-constant length (minItems == maxItems small objects of fixed-width patterns, enums,
   bounded integers, booleans). After a warm-up turn of each kind, free requests get max_tokens =
   the warm-up's mean constrained completion tokens and ignore_eos: both kinds keep a full batch
   for the same tokens. Kinds alternate (the leader too, per round); tok/s = usage tokens / turn
   wall time; target: median constrained / median free >= 0.9x.
2. Mask share: /metrics deltas over the constrained turns: grammar_mask_seconds / their wall time
   (the engine is busy throughout), mask time per masked row, and per step against the step-time
   gap to free turns. "other CPU" is the box's CPU use by neither server nor client (noise).
3. Compile, in process after the server stops: GrammarCompiler on the model's tokenizer (as
   engine/llm_engine.py builds it). Cold: the first submit(spec).result() of a schema new to the
   compiler (median of --compiles, each with its own "title"); cached: a second submit, and the
   same schema re-indented through StructuredOutput.json (canonical key) + submit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
for _p in (Path(__file__).resolve().parent.parent / "tests", Path(__file__).resolve().parent):
    if str(_p) not in sys.path:  # server_fixtures; tables
        sys.path.insert(0, str(_p))

from openai import AsyncOpenAI
from server_fixtures import MODEL, RunningServer, run_server, scrape
from tables import markdown_table, write_json

BATCH = 32
ITEM = {"type": "object", "additionalProperties": False,
        "required": ["sku", "color", "size", "in_stock"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                       "color": {"enum": ["red", "green", "blue", "black"]},
                       "size": {"type": "integer", "minimum": 1, "maximum": 9},
                       "in_stock": {"type": "boolean"}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["store", "items"],
          "properties": {"store": {"type": "integer", "minimum": 10, "maximum": 99},
                         "items": {"type": "array", "minItems": 5, "maxItems": 5, "items": ITEM}}}


def large_schema(n: int = 50) -> dict[str, Any]:
    """n properties, every third a string with a pattern, the others enums, numbers, strings."""
    kinds = [{"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}(-[a-z]+)?$"},
             {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,6}$"},
             {"type": "integer", "minimum": 0, "maximum": 1000},
             {"enum": ["alpha", "beta", "gamma", "delta"]},
             {"type": "string", "maxLength": 24}, {"type": "number"}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Store number {10 + i} lists five products. Write its "
             "inventory as JSON with the store number and the items (sku, color, size, stock)."}]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


async def turn(client: AsyncOpenAI, constrained: bool, max_tokens: int) -> dict[str, Any]:
    """BATCH concurrent requests of one kind; tokens from usage, wall time of the whole turn."""
    extra: dict[str, Any] = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "inventory", "schema": SCHEMA}}} if constrained else {}

    async def one(i: int):
        return await client.chat.completions.create(
            model=MODEL, messages=messages(i), temperature=0, max_tokens=max_tokens,
            extra_body={"ignore_eos": not constrained, **extra})

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(i) for i in range(BATCH)))
    wall = time.perf_counter() - t0
    tokens = [o.usage.completion_tokens for o in outs]
    valid = sum(is_json(o.choices[0].message.content or "") for o in outs)
    return {"kind": "constrained" if constrained else "free", "wall_s": wall,
            "tokens": sum(tokens), "min_tokens": min(tokens), "max_tokens": max(tokens),
            "mean_tokens": statistics.mean(tokens), "tok_s": sum(tokens) / wall,
            "valid_json": valid, "finish": sorted({o.choices[0].finish_reason for o in outs}),
            "sample": outs[0].choices[0].message.content}


COUNTERS = ("tierserve:grammar_mask_seconds_total", "tierserve:grammar_masked_rows_total",
            "tierserve:engine_steps_total", "tierserve:structured_requests_total",
            "tierserve:grammar_cache_hits_total", "tierserve:grammar_compile_seconds_count")


def counters(server: RunningServer) -> dict[str, float]:
    """The COUNTERS now, and the CPU seconds the box, the server and this process have used
    (Linux /proc; "other" CPU during a turn is what neither used: noise from other work)."""
    m = scrape(server)
    out = {k: m.get(k, 0.0) for k in COUNTERS}
    try:
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:9]]
        own = 0
        for pid in (server.proc.pid, os.getpid()):
            with open(f"/proc/{pid}/stat") as f:
                own += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        out["other_cpu_s"] = (sum(cpu) - cpu[3] - cpu[4] - own) / hz
    except (OSError, ValueError):
        out["other_cpu_s"] = float("nan")
    return out


async def throughput(server: RunningServer, rounds: int) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=server.v1, api_key="unused", timeout=600, max_retries=0)
    cap = 4 * 128  # the constrained requests end when the grammar does; this only bounds a bug
    log("warm-up: one constrained and one free turn")
    warm = await turn(client, True, cap)
    free_len = round(warm["mean_tokens"])
    await turn(client, False, free_len)
    log(f"  constrained: {warm['min_tokens']}-{warm['max_tokens']} tokens, mean "
        f"{warm['mean_tokens']:.1f} -> free max_tokens {free_len}; sample {warm['sample']}")
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            before = counters(server)
            res = await turn(client, constrained, cap if constrained else free_len)
            after = counters(server)
            delta = {k: after[k] - before[k] for k in after}
            res |= {"round": r + 1, "delta": delta,
                    "other_cores": delta["other_cpu_s"] / res["wall_s"],
                    "ms_step": 1e3 * res["wall_s"] / max(1, delta["tierserve:engine_steps_total"])}
            runs.append(res)
            log(f"round {r + 1}/{rounds} {res['kind']:>11}: {res['tokens']} tokens in "
                f"{res['wall_s']:.2f} s = {res['tok_s']:.1f} tok/s, {res['ms_step']:.1f} ms/step, "
                f"other CPU {res['other_cores']:.2f} cores")
    await client.close()
    return {"free_max_tokens": free_len, "warmup": warm, "runs": runs}


def compile_times(repeats: int) -> list[dict[str, Any]]:
    from tierserve.engine.sampling_params import StructuredOutput
    from tierserve.engine.tokenizer import TextTokenizer
    from tierserve.engine.worker.grammar import GrammarCompiler
    from tierserve.engine.worker.loaders import load_model_source

    src = load_model_source(MODEL)
    comp = GrammarCompiler(TextTokenizer(src.tokenizer), src.config.vocab_size,
                           tuple(src.config.eos_token_ids))
    comp.submit(StructuredOutput.json({"type": "object"})).result()  # one-time set-up, not timed

    def timed(spec: StructuredOutput | str) -> float:
        """ms to a compiled grammar; a str (a schema's text) is canonicalized inside the timing."""
        t0 = time.perf_counter()
        comp.submit(StructuredOutput.json(spec) if isinstance(spec, str) else spec).result()
        return (time.perf_counter() - t0) * 1e3

    rows = []
    for name, schema in (("benchmark schema", SCHEMA), ("50 properties, patterns", large_schema())):
        cold, cached, respaced = [], [], []
        for i in range(repeats):
            s = {"title": f"{name} {i} {time.time_ns()}", **schema}  # a key new to the cache
            spec = StructuredOutput.json(s)
            cold.append(timed(spec))
            cached.append(timed(spec))
            respaced.append(timed(json.dumps(s, indent=4)))
        rows.append({"schema": name, "bytes": len(json.dumps(schema)),
                     "cold_ms": statistics.median(cold), "cold_all_ms": cold,
                     "cached_ms": statistics.median(cached),
                     "respaced_ms": statistics.median(respaced)})
        log(f"compile {name}: cold {', '.join(f'{c:.0f}' for c in cold)} ms")
    comp.close()
    return rows


def report(tp: dict[str, Any], comp: list[dict[str, Any]], cmd: str) -> dict[str, Any]:
    runs = tp["runs"]
    by = {k: [r for r in runs if r["kind"] == k] for k in ("free", "constrained")}
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in by.items()}
    step = {k: statistics.median(r["ms_step"] for r in v) for k, v in by.items()}
    ratio = med["constrained"] / med["free"]
    per_round = [c["tok_s"] / f["tok_s"] for c in by["constrained"] for f in by["free"]
                 if c["round"] == f["round"]]
    d = {k: sum(r["delta"][k] for r in by["constrained"]) for k in COUNTERS}
    wall = sum(r["wall_s"] for r in by["constrained"])
    mask_s = d["tierserve:grammar_mask_seconds_total"]
    rows = d["tierserve:grammar_masked_rows_total"]
    mask_step = 1e3 * mask_s / max(1, d["tierserve:engine_steps_total"])

    print(f"\n    {cmd}\n")
    print(f"## Throughput: {BATCH} concurrent chat requests, JSON schema vs free "
          f"(free: max_tokens {tp['free_max_tokens']}, ignore_eos)\n")
    print(markdown_table(
        ["round", "kind", "tokens", "per request", "wall (s)", "steps", "ms/step", "output tok/s",
         "other CPU (cores)", "valid JSON"], "rlrrrrrrrr",
        [(r["round"], r["kind"], r["tokens"], f"{r['min_tokens']}-{r['max_tokens']}",
          f"{r['wall_s']:.2f}", f"{r['delta']['tierserve:engine_steps_total']:.0f}",
          f"{r['ms_step']:.1f}", f"{r['tok_s']:.1f}", f"{r['other_cores']:.2f}",
          f"{r['valid_json']}/{BATCH}" if r["kind"] == "constrained" else "-") for r in runs]))
    print()
    print(markdown_table(["kind", "median output tok/s", "median ms/step"], "lrr",
                         [(k, f"{med[k]:.1f}", f"{step[k]:.1f}") for k in by]))
    print(f"\nratio constrained / free = **{ratio:.2f}x** (target >= 0.9x; per round: "
          + ", ".join(f"{x:.2f}x" for x in per_round) + ")")
    print("\n## Mask share of the constrained turns (/metrics deltas)\n")
    print(markdown_table(
        ["wall (s)", "mask (s)", "share of wall", "masked rows", "µs / row", "mask ms / step",
         "median step ms, constrained - free"], "rrrrrrr",
        [(f"{wall:.2f}", f"{mask_s:.3f}", f"{100 * mask_s / wall:.2f}%", f"{rows:.0f}",
          f"{1e6 * mask_s / max(1, rows):.1f}", f"{mask_step:.2f}",
          f"{step['constrained'] - step['free']:+.2f}")]))
    print(f"\nstructured requests {d['tierserve:structured_requests_total']:.0f}, compile cache "
          f"hits {d['tierserve:grammar_cache_hits_total']:.0f}, compiles "
          f"{d['tierserve:grammar_compile_seconds_count']:.0f} during the timed turns")
    print("\n## Grammar compile (in process, GrammarCompiler on the model's tokenizer)\n")
    print(markdown_table(["schema", "JSON bytes", "cold (ms)", "cached (ms)",
                          "re-spaced, cached (ms)"], "lrrrr",
                         [(c["schema"], c["bytes"], f"{c['cold_ms']:.1f}", f"{c['cached_ms']:.3f}",
                           f"{c['respaced_ms']:.3f}") for c in comp]))
    print(f"\nsummary: constrained {med['constrained']:.1f} vs free {med['free']:.1f} output tok/s "
          f"= {ratio:.2f}x ({'meets' if ratio >= 0.9 else 'misses'} >= 0.9x); mask "
          f"{100 * mask_s / wall:.1f}% of wall, {1e6 * mask_s / max(1, rows):.0f} µs/row; compile "
          + ", ".join(f"{c['schema']} cold {c['cold_ms']:.0f} ms / cached {c['cached_ms']:.3f} ms"
                      for c in comp))
    return {"command": cmd, "median_tok_s": med, "median_ms_step": step, "ratio": ratio,
            "ratio_per_round": per_round, "mask_seconds": mask_s, "masked_rows": rows,
            "constrained_wall_s": wall, "mask_share": mask_s / wall, "throughput": tp,
            "compile": comp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed turns of each kind")
    ap.add_argument("--compiles", type=int, default=3, help="cold compiles per schema (median)")
    ap.add_argument("--threads", type=int, default=None, help="the server's --num-threads")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    cmd = " ".join([os.path.relpath(sys.executable), *sys.argv])
    extra = ["--max-num-seqs", str(BATCH), "--kv-cache-memory-bytes", "1GiB",
             "--kv-tiers", "none"]
    if args.threads:
        extra += ["--num-threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        log("starting tierserve serve")
        with run_server(Path(tmp), *extra) as server:
            tp = asyncio.run(throughput(server, args.rounds))
    comp = compile_times(args.compiles)
    result = report(tp, comp, cmd)
    if args.json:
        write_json(args.json, result | {"args": vars(args)})


if __name__ == "__main__":
    main()
