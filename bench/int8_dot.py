"""One decode step's decoder matmuls of the embedded SmolLM2-135M, per token, by three native
kernels over the model's own Q4_1 weights:

    q4i8      ops.q4i8_linear: 4-bit weights x int8-rounded activations (csrc/q4_int8.cpp)
    q4        ops.q4_linear: the exact 4-bit kernel, weights decoded to fp32 (csrc/quant_linear.cpp)
    fp32      ops.packed_linear over the dequantized weights

    python bench/int8_dot.py                       # M = 1, 2, 4, 8, 16, 64; ~1 minute on 2 cores
    python bench/int8_dot.py --rows 1,8 --rounds 20 --json out.json

A token is 30 layers x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), each layer its
own weights (so they stream from memory, as in serving), one Python call per linear. The kernels
take turns within each round in a shuffled order and the best round counts: a shared box moves
absolute times by 2-3x from minute to minute, the ratios far less.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.tables import cpu_line, markdown_table, write_json  # noqa: E402
from tierserve.engine.worker.loaders import load_model_source  # noqa: E402
from tierserve.engine.worker.quant import (Int4DotWeight, Int4Groups, Int4Weight,  # noqa: E402
                                           blocks_to_groups)
from tierserve.kernels.native import load_extension  # noqa: E402

KERNELS = ("q4i8", "q4", "fp32")
BYTES_PER_WEIGHT = {"q4i8": 0.625, "q4": 0.75, "fp32": 4.0}
PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "down": ("mlp.down_proj",)}


def layer_groups(blocks: dict, layer: int) -> dict[str, Int4Groups]:
    """A layer's four linears as the model fuses them (q, k, v into qkv; gate, up into gate_up)."""
    return {name: Int4Groups.cat([blocks_to_groups(
        blocks[f"model.layers.{layer}.{p}.weight"]) for p in parts])
        for name, parts in PARTS.items()}


def kernel_calls(ops, g: Int4Groups) -> dict:
    """For each kernel, a function of x giving x W^T for these groups, packed for that kernel."""
    n = g.codes.shape[0]
    packed = Int4DotWeight(g).packed  # what --quantization gguf holds
    q4 = Int4Weight(g, native=True)
    codes, d, z = q4.codes, q4.d, q4.z
    panels = ops.pack_linear_weight(g.dequantize())
    return {"q4i8": lambda x: ops.q4i8_linear(x, packed, n),
            "q4": lambda x: ops.q4_linear(x, codes, d, z, n),
            "fp32": lambda x: ops.packed_linear(x, panels, n)}


def build_model(ops, layers: int) -> tuple[list[dict], int]:
    """Per linear of the token, in order: (K, {kernel: call}); and the weights' count."""
    blocks = load_model_source("smollm2-135m").blocks
    calls, weights = [], 0
    for layer in range(layers):
        for g in layer_groups(blocks, layer).values():
            calls.append((g.codes.shape[1], kernel_calls(ops, g)))
            weights += g.codes.numel()
    return calls, weights


def token_seconds(calls: list, kernel: str, xs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for k, by_kernel in calls:
        by_kernel[kernel](xs[k])
    return time.perf_counter() - t


def best_token_ms(calls: list, rows: int, rounds: int, seed: int) -> dict[str, float]:
    """Each kernel's best token time over `rounds` (a first, uncounted round warms up)."""
    gen = torch.Generator().manual_seed(seed)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {k for k, _ in calls}}
    order, best = list(KERNELS), {kn: float("inf") for kn in KERNELS}
    shuffle = random.Random(seed)
    for r in range(rounds + 1):
        shuffle.shuffle(order)
        for kn in order:
            s = token_seconds(calls, kn, xs)
            if r:
                best[kn] = min(best[kn], s * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64", help="rows of x (M) to time")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ops = load_extension()
    if ops is None:
        sys.exit("the native extension could not be built here (see the log)")
    torch.set_num_threads(args.threads)
    calls, weights = build_model(ops, args.layers)
    results = {}
    for rows in (int(v) for v in args.rows.split(",")):
        results[rows] = best_token_ms(calls, rows, args.rounds, seed=rows)
        print(f"M={rows}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in results[rows].items()),
              file=sys.stderr)
    print(cpu_line() + f"; {args.threads} threads; best of {args.rounds} rounds")
    print(markdown_table(
        ["M", "q4i8 ms", "q4 ms", "fp32 ms", "q4 / q4i8", "fp32 / q4i8", "q4i8 GB/s"], "rrrrrrr",
        [[m, *(f"{r[k]:.2f}" for k in KERNELS), f"{r['q4'] / r['q4i8']:.1f}x",
          f"{r['fp32'] / r['q4i8']:.1f}x",
          f"{weights * BYTES_PER_WEIGHT['q4i8'] / r['q4i8'] / 1e6:.1f}"]
         for m, r in results.items()]))
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "args": vars(args), "token_ms": results})


if __name__ == "__main__":
    main()
