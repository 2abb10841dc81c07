"""Offline throughput: tierserve against Hugging Face transformers on the same model, in one run.

    python bench/throughput.py                  # full run (a few minutes on 2 cores)
    python bench/throughput.py --skip-hf        # tierserve only
    python bench/throughput.py --repeat 3       # both engines 3 times, alternating; median ratio
    python bench/throughput.py --hf-batch-size 8,16,32   # transformers at each; the fastest counts

Workload (in the spirit of nano-vllm's bench): a fixed seed, N requests, prompt lengths and output
lengths drawn uniformly, random token ids, ignore_eos. transformers runs the same requests in
static batches (left-padded, each batch decodes to its longest output); both count only the
requested output tokens. Same dtype (fp32) and the same torch thread count.

Also: decode-step time at several batch sizes against this machine's fp32 roofline (the model's
matmul FLOPs per token over a measured large-GEMM FLOP/s).

    python bench/throughput.py --skip-hf --kv-cache-dtype float16   # tierserve, fp16 KV cache
    python bench/throughput.py --skip-hf --quantization gguf        # the GGUF's own Q4 weights
    python bench/throughput.py --skip-hf --min-output 1 --max-output 8 --prefill-bf16  # prefill-heavy

Modes side by side (issue 44's prefill-heavy bound): --against runs further engines, one per
--quantization mode, on the same workload in turns with the first (each repeat: the first, then
each of them), and prints each mode's median time:

    python bench/throughput.py --skip-hf --quantization auto --against none --repeat 3 \
        --min-output 1 --max-output 8 --decode-batches ""

The KV cache is fp32 (the model's dtype) unless --kv-cache-dtype says otherwise; the tables name
it. transformers always keeps its cache in fp32. The decode-step table is also measured with the
KV dtypes of --decode-kv-also (default float16; "" for none), each in an engine of its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tierserve.engine import LLM, SamplingParams  # noqa: E402
from tierserve.engine.env import configure_threads  # noqa: E402
from tierserve.kernels.native import load_extension  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gemm_flops(n: int = 2048, reps: int = 5) -> float:
    """The best large fp32 GEMM rate of this machine: torch.matmul (MKL), oneDNN's prepacked
    linear and the native packed kernel (kernels/csrc/gemm.cpp, what the engine uses on the CPU),
    whichever is fastest here. On Intel MKL usually wins; on AMD oneDNN or the native kernel does
    (MKL takes a slower path there): the highest number is the strictest roofline."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    paths = [lambda: a @ b]
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        paths.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    ext = load_extension()
    if ext is not None:
        panels = ext.pack_linear_weight(b)
        paths.append(lambda: ext.packed_linear(a, panels, n))
    best = float("inf")
    for f in paths:
        f()
        for _ in range(reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(10000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def run_tierserve(llm: LLM, reqs) -> float:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    dt = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(o for _, o in reqs)
    return dt


def run_hf(path: str, reqs, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=max(o for _, o in chunk))
        log(f"  transformers: {min(i + batch, len(reqs))}/{len(reqs)} requests, "
            f"{time.perf_counter() - t:.0f} s")
    return time.perf_counter() - t


def decode_steps(llm: LLM, batches: list[int], context: int, steps: int) -> dict[int, float]:
    """Time of one decode step with exactly b sequences running, each at ~`context` tokens."""
    eng = llm.engine
    rng = random.Random(1)
    res = {}
    for b in batches:
        ids = [f"d{b}-{i}" for i in range(b)]
        # The first prompts decode while later ones prefill (chunked prefill): give every request
        # room for those tokens too (decodes share each step's token budget: at most b more steps),
        # so none finishes before the timed steps end.
        prefill_steps = -(-b * context // eng.config.scheduler.max_num_batched_tokens) + b
        for rid in ids:
            eng.add_request(rid, [rng.randrange(10000) for _ in range(context)],
                            SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 8,
                                           ignore_eos=True))
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                           for r in eng.scheduler.running):
            eng.step()
        for _ in range(4):
            eng.step()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        res[b] = (time.perf_counter() - t) / steps
        running = len(eng.scheduler.running)
        assert running == b, f"decode batch {b}: only {running} sequences were still running"
        eng.abort_request(ids)
        log(f"  decode batch {b}: {res[b] * 1e3:.1f} ms/step")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--hf-batch-size", default="16",
                    help="transformers' static batch size, or a comma list: each is run and the "
                         "fastest is the baseline (the strongest transformers this workload allows)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", default="none",
                    help="tierserve's --quantization (none, gguf, int8, int4, auto)")
    ap.add_argument("--against", default="",
                    help="comma list of further --quantization modes, each timed on the workload "
                         "in turns with the first engine (a table of median times)")
    ap.add_argument("--prefill-bf16", action="store_true",
                    help="tierserve's --prefill-bf16 (AMX CPUs): prefill GEMMs in bf16")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run both engines this many times, alternating, and report the median "
                         "ratio (for noisy machines; each repeat takes the full workload time)")
    ap.add_argument("--decode-batches", default="1,8,32,64")
    ap.add_argument("--decode-context", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="tierserve's KV cache dtype: auto (the model's, fp32) or float16")
    ap.add_argument("--decode-kv-also", default="float16",
                    help="comma list of further KV dtypes for the decode-step table")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    args = ap.parse_args()

    threads = configure_threads(args.threads)
    llm = LLM(model=args.model, max_num_seqs=max(64, args.num_requests),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=3 << 30,
              num_threads=threads, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, prefill_bf16=args.prefill_bf16)
    kv = str(llm.engine.executor.facts().kv_dtype).removeprefix("torch.")
    mc = llm.engine.model_config
    flops = gemm_flops()
    roof = flops / mc.flops_per_token()
    log(f"roofline: large fp32 GEMM {flops / 1e9:.0f} GFLOP/s, {mc.flops_per_token() / 1e9:.3f} "
        f"GFLOP/token -> {roof:.0f} tok/s")
    # Warm-up: first touches of the KV cache pages, the kernel build, oneDNN's primitive cache.
    llm.generate([[1, 2, 3] * 100] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    steps = decode_steps(llm, batches, args.decode_context, args.decode_steps)
    by_kv = {kv: steps}
    for name in [x for x in args.decode_kv_also.split(",") if x]:
        other = LLM(model=args.model, max_num_seqs=max(64, args.num_requests),
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory_bytes=3 << 30, num_threads=threads, kv_cache_dtype=name,
                    quantization=args.quantization, prefill_bf16=args.prefill_bf16)
        other_kv = str(other.engine.executor.facts().kv_dtype).removeprefix("torch.")
        if other_kv in by_kv:
            continue
        log(f"decode steps with a {other_kv} KV cache")
        other.generate([[1, 2, 3] * 100] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
        by_kv[other_kv] = decode_steps(other, batches, args.decode_context, args.decode_steps)
        del other
        gc.collect()

    reqs = workload(args)
    out_tokens = sum(o for _, o in reqs)
    log(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{out_tokens} output tokens")
    hf_batches = [int(x) for x in str(args.hf_batch_size).split(",") if x]
    others = {m: LLM(model=args.model, max_num_seqs=max(64, args.num_requests),
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     kv_cache_memory_bytes=3 << 30, num_threads=threads,
                     kv_cache_dtype=args.kv_cache_dtype, quantization=m,
                     prefill_bf16=args.prefill_bf16)
              for m in args.against.split(",") if m}
    for other in others.values():
        other.generate([[1, 2, 3] * 100] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
    by_mode: dict[str, list[float]] = {args.quantization: [], **{m: [] for m in others}}
    runs: list[tuple[float, float | None]] = []
    hf_by_batch: list[dict[int, float]] = []
    for i in range(args.repeat):
        if args.repeat > 1:
            log(f"repeat {i + 1}/{args.repeat}")
        llm.engine.pool.reset_prefix_cache()  # each repeat computes every prompt token again
        ours = run_tierserve(llm, reqs)
        by_mode[args.quantization].append(ours)
        log(f"  tierserve: {ours:.1f} s")
        for m, other in others.items():
            other.engine.pool.reset_prefix_cache()
            by_mode[m].append(run_tierserve(other, reqs))
            log(f"  tierserve --quantization {m}: {by_mode[m][-1]:.1f} s")
        times = {} if args.skip_hf else {b: run_hf(llm.engine.model_path, reqs, b)
                                         for b in hf_batches}
        hf_by_batch.append(times)
        runs.append((ours, min(times.values()) if times else None))
    if args.repeat > 1:  # report the run with the median ratio (median tierserve time without HF)
        key = (lambda r: r[1] / r[0]) if not args.skip_hf else (lambda r: -r[0])
        ours, hf = sorted(runs, key=key)[len(runs) // 2]
    else:
        ours, hf = runs[0]
    # the batch size whose time is the baseline of the reported run
    hf_batch = next((min(t, key=t.get) for t in hf_by_batch if t and min(t.values()) == hf), None)

    print(f"\n## tierserve vs transformers ({threads} threads, fp32, tierserve KV {kv}, backend "
          f"{llm.engine.executor.facts().backend})\n")
    print("| engine | time (s) | output tok/s |")
    print("|---|---:|---:|")
    print(f"| tierserve | {ours:.1f} | {out_tokens / ours:.1f} |")
    if hf is not None:
        print(f"| transformers (static batches of {hf_batch}) | {hf:.1f} | "
              f"{out_tokens / hf:.1f} |")
        if len(hf_batches) > 1:
            print("\ntransformers by batch size (s): " + "; ".join(
                ", ".join(f"{b}: {t:.1f}" for b, t in times.items()) for times in hf_by_batch))
        print(f"\nratio: tierserve / transformers = **{hf / ours:.2f}x**")
        if len(runs) > 1:
            print(f"(median of {len(runs)} runs; all ratios: "
                  + ", ".join(f"{h / o:.2f}x" for o, h in runs) + ")")
    if others:
        print_modes(by_mode, out_tokens)
    print(f"\n## decode step (context {args.decode_context}; roofline {roof:.0f} tok/s from "
          f"{flops / 1e9:.0f} GFLOP/s)\n")
    print("| batch | KV cache | ms/step | tok/s | % of roofline |")
    print("|---:|---|---:|---:|---:|")
    for b in batches:
        for name, res in by_kv.items():
            dt = res[b]
            print(f"| {b} | {name} | {dt * 1e3:.1f} | {b / dt:.0f} | {100 * b / dt / roof:.1f}% |")

    result = {"threads": threads, "kv_cache_dtype": kv, "gemm_gflops": flops / 1e9,
              "roofline_tok_s": roof,
              "tierserve_s": ours, "transformers_s": hf, "output_tokens": out_tokens,
              "runs": [{"tierserve_s": o, "transformers_s": h,
                        "transformers_s_by_batch": {str(b): t for b, t in times.items()}}
                       for (o, h), times in zip(runs, hf_by_batch)],
              "decode_ms": {b: dt * 1e3 for b, dt in steps.items()},
              "decode_ms_by_kv": {name: {b: dt * 1e3 for b, dt in res.items()}
                                  for name, res in by_kv.items()},
              "by_quantization_s": by_mode, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


def print_modes(by_mode: dict[str, list[float]], out_tokens: int) -> None:
    """Each --quantization mode's median time on the workload, the first mode's ratio to each."""
    from bench.tables import cpu_line

    med = {m: sorted(t)[len(t) // 2] for m, t in by_mode.items()}
    first = next(iter(med))
    print(f"\n## quantization modes in turns ({len(by_mode[first])} rounds each, medians; "
          f"{cpu_line()})\n")
    print("| --quantization | time (s), each round | median (s) | output tok/s | "
          f"{first} speed-up |")
    print("|---|---|---:|---:|---:|")
    for m, t in by_mode.items():
        print(f"| {m} | {', '.join(f'{x:.1f}' for x in t)} | {med[m]:.1f} | "
              f"{out_tokens / med[m]:.1f} | {med[m] / med[first]:.2f}x |")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["tierserve"] + (["transformers"] if r["transformers_s"] else [])
    vals = [r["output_tokens"] / r["tierserve_s"]] + (
        [r["output_tokens"] / r["transformers_s"]] if r["transformers_s"] else [])
    a.bar(names, vals, color=["tab:blue", "tab:gray"][:len(vals)])
    a.set_ylabel("output tok/s")
    a.set_title("offline throughput")
    by_kv = r.get("decode_ms_by_kv") or {r.get("kv_cache_dtype", "float32"): r["decode_ms"]}
    for name, res in by_kv.items():
        b.plot([int(k) for k in res], [int(k) / (v / 1e3) for k, v in res.items()], "o-",
               label=f"tierserve decode, {name} KV")
    b.axhline(r["roofline_tok_s"], color="red", ls="--", label="fp32 roofline")
    b.axhline(r["roofline_tok_s"] / 2, color="red", ls=":", label="50% of it")
    b.set_xlabel("batch")
    b.set_ylabel("tok/s")
    b.set_title("decode step")
    b.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
