"""Quantized weights against the fp32 path, in one run on this box: quality, bytes and speed.

    python bench/quant.py                         # every mode; a few minutes on 2 cores
    python bench/quant.py --modes none,gguf --rounds 3 --json out.json

Quality: llama.cpp's perplexity method on tests/data/long_text.md (engine/eval/quant.py):
top-1 agreement with the fp32 path and the perplexity change. Speed, offline (the engine alone,
no HTTP): one stream's decode time per token (128 tokens after a short prompt, ignore_eos), and
32 streams' output tokens/s (64-token prompts, 128 output tokens each); the engines take turns
each round, and the median counts. Weight bytes: what each engine holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tables import cpu_line, markdown_table, write_json  # noqa: E402
from tierserve.engine import LLM, SamplingParams  # noqa: E402
from tierserve.engine.eval.quant import agreement, perplexity_change, score  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                    "long_text.md")


def one_stream_ms(llm: LLM, tokens: int) -> float:
    """Decode ms per token of one request (first token to last; prefill excluded)."""
    out = llm.generate("Once upon a time, in a land far away,",
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    m = out.metrics
    return (m["last_token"] - m["first_token"]) / (tokens - 1) * 1e3


def batch_tok_s(llm: LLM, streams: int, tokens: int) -> float:
    tok = llm.get_tokenizer()
    base = tok.encode(open(TEXT).read())
    prompts = [base[i * 64:(i + 1) * 64] for i in range(streams)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return streams * tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default="none,gguf-exact,gguf,int8,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    llms = {m: LLM(quantization=m, kv_cache_memory_bytes=1 << 29) for m in modes}
    ids = llms[modes[0]].get_tokenizer().encode(open(TEXT).read())[:args.eval_tokens]
    scores = {}
    for m, llm in llms.items():
        print(f"scoring {m} on {len(ids)} tokens", file=sys.stderr)
        scores[m] = score(llm, ids)
    single, batch = {m: [] for m in modes}, {m: [] for m in modes}
    for m, llm in llms.items():  # warm-up: first-use allocations, the native build
        one_stream_ms(llm, 8)
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            single[m].append(one_stream_ms(llms[m], 128))
            batch[m].append(batch_tok_s(llms[m], args.streams, 128))
            print(f"round {r + 1}/{args.rounds} {m}: {single[m][-1]:.1f} ms/token at one stream, "
                  f"{batch[m][-1]:.0f} tok/s at {args.streams}", file=sys.stderr)
    ref = modes[0]
    rows, results = [], {}
    for m in modes:
        ms, tps = statistics.median(single[m]), statistics.median(batch[m])
        wb = llms[m].engine.executor.facts().weight_bytes
        res = dict(weight_mib=wb / 2**20, agreement=agreement(scores[m], scores[ref]),
                   perplexity=scores[m].perplexity,
                   perplexity_change=perplexity_change(scores[m], scores[ref]),
                   one_stream_ms=ms, one_stream_tok_s=1e3 / ms, batch_tok_s=tps)
        results[m] = res
        rows.append([m, f"{res['weight_mib']:.0f}", f"{res['agreement'] * 100:.2f}%",
                     f"{res['perplexity']:.3f}", f"{res['perplexity_change'] * 100:+.2f}%",
                     f"{ms:.1f}", f"{1e3 / ms:.1f}", f"{statistics.median(single[ref]) / ms:.2f}x",
                     f"{tps:.0f}", f"{tps / statistics.median(batch[ref]):.2f}x"])
    print("\n    " + " ".join(["python bench/quant.py"] + sys.argv[1:]) + "\n")
    print(cpu_line() + "\n")
    print(markdown_table(["mode", "weights MiB", f"top-1 vs {ref}", "perplexity", "ppl change",
                          "1 stream ms/token", "tok/s", "speed-up",
                          f"{args.streams} streams tok/s", "speed-up"],
                         "lrrrrrrrrr", rows))
    print(f"\n{len(scores[ref].top1)} scored positions; {args.rounds} rounds, medians; per round: "
          + "; ".join(f"{m} {', '.join(f'{x:.1f}' for x in single[m])} ms" for m in modes))
    if args.json:
        write_json(args.json, {"modes": results, "rounds": {"one_stream_ms": single,
                                                             "batch_tok_s": batch}})


if __name__ == "__main__":
    main()
