"""Serving benchmark in the spirit of `vllm bench serve`, for any OpenAI-compatible server.

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 32 --max-concurrency 8 \
        --input-len 64 --output-len 32 --slo-ttft-ms 2000 --slo-tpot-ms 200

A random dataset (token-id prompts drawn with a fixed seed) is sent to /v1/completions as
streaming requests, either at a Poisson request rate (--request-rate) or as fast as a fixed
number of clients allow (--max-concurrency). Prints TTFT / TPOT / ITL / E2E percentiles,
request and token throughput, and goodput (requests per second meeting every given SLO)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(1000, vocab // 2)  # skip the low ids, where special tokens usually live
    return [[rng.randrange(lo, vocab) for _ in range(input_len)] for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = Result(ok=False, prompt_tokens=len(prompt)), None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # --no-keepalive: a new connection per request (llama-server closes each one after a
    # streamed response although it answers Keep-Alive; a reused one can then fail)
    keep = 0 if getattr(args, "no_keepalive", False) else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=keep)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        model = args.model or (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
        url = base + "/v1/completions"
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed + 1)

        async def limited(p):
            async with sem:
                return await one_request(client, url, model, p, args.output_len)

        await one_request(client, url, model, prompts[0][:8], 2)  # warm-up, not counted
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok
            if (args.slo_ttft_ms is None or r.ttft * 1e3 <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or (r.tpot or 0) * 1e3 <= args.slo_tpot_ms)
            and (args.slo_e2e_ms is None or r.e2e * 1e3 <= args.slo_e2e_ms)]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration,
               "output_token_throughput": out_tokens / duration,
               "total_token_throughput": (in_tokens + out_tokens) / duration,
               "goodput": len(good) / duration}
    for name, vals in series.items():
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = pct(vals, q) * 1e3
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def print_table(s: dict, args: argparse.Namespace) -> None:
    mode = (f"concurrency {args.max_concurrency}" if args.max_concurrency
            else f"rate {args.request_rate}/s")
    print(f"{'=' * 15} Serving benchmark ({mode}) {'=' * 15}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
            ("Goodput (req/s)", f"{s['goodput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>12}")
    print(f"{'metric (ms)':<12}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{name.upper():<12}" + "".join(f"{s[f'{name}_p{q}_ms']:>10.1f}" for q in (50, 90, 99)))
    if "first_error" in s:
        print("first error:", s["first_error"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--vocab-size", type=int, default=32000, help="random token ids are below this")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="clients in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-keepalive", action="store_true",
                   help="a new connection per request (for servers that close them)")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args(argv)
    results, duration = asyncio.run(run(args))
    summary = summarize(results, duration, args)
    print_table(summary, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"request_rate": str(args.request_rate)},
                       "summary": summary}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
