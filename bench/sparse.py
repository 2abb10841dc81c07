"""Sparse top-k decode against dense, in one run on this machine (docs/BENCHMARKS.md, docs/sparse.md).

1. Speed: decode step time (the whole model, one decode per sequence) and attention time (the
   attention kernels alone, over every layer's cache) at contexts of 1k, 2k, 4k and 8k tokens and
   batch 1 and 8, dense against sparse with K an eighth of the blocks (--ratio). The KV cache is
   filled with random values: attention's cost does not depend on them.
2. Metadata: bytes and build time of the step's metadata with the adaptive (power-of-two) table
   width against an always-capacity width, on a batch of one long and many short requests.
3. Accuracy (--accuracy): teacher-forced top-1 agreement with dense and the perplexity change over
   K from 1/16 to 1/2 of the blocks, two dense layers, on tests/data/long_text.md.
4. Granularity (--granularity, alone): the same at K = 1/4 with block sizes 4, 8, 16 and 32.
5. Kernel (--kernel, alone): the native attention kernels by themselves at context 8192, block 16,
   K = n/8, SmolLM2's heads, fp32, batch 1 and 8, with every thread and with one: dense
   paged_decode against sparse_paged_decode, and the selection's time per (sequence, KV head).
   Each call reads another of several layers' caches (about 200 MB in all), so each finds its
   blocks cold, as in a model. A table, and OUT/sparse_kernel.json.

    .venv/bin/python bench/sparse.py [--accuracy] [--out docs/]
    .venv/bin/python bench/sparse.py --granularity [--replot]   # plot: docs/sparse_granularity.png
    .venv/bin/python bench/sparse.py --kernel [--repeat 1]      # 4 calls per layer by default
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tierserve.engine.core.kv_hints import KVHints  # noqa: E402
from tierserve.engine.llm import LLM  # noqa: E402
from tierserve.engine.core.request import Request, RequestId  # noqa: E402
from tierserve.engine.sampling_params import SamplingParams  # noqa: E402
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # sparse_fixtures: the kernel tests' random batches
CONTEXTS = (1024, 2048, 4096, 8192)
BATCHES = (1, 8)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_steps(runner, batch: int, ctx: int, sparse: bool) -> SchedulerOutput:
    """`batch` decodes at context `ctx`, each over its own run of blocks."""
    bs, nb = runner.block_size, -(-ctx // runner.block_size)
    steps = []
    for i in range(batch):
        r = Request(RequestId(f"b{i}"), [1] * ctx, SamplingParams(max_tokens=1, temperature=0), 1,
                    hints=KVHints(sparse_attention=sparse))
        steps.append(ScheduledRequest(r, ctx - 1, 1, tuple(range(i * nb, (i + 1) * nb)), True))
    assert bs * nb >= ctx
    return SchedulerOutput(tuple(steps), batch)


def attention_time(runner, batch: int, ctx: int, ratio: float, repeat: int) -> tuple[float, float]:
    """Seconds for one decode's attention over every layer: (dense kernel, sparse kernel)."""
    ext, mc, bs = runner.native, runner.model_cfg, runner.block_size
    nb = -(-ctx // bs)
    tables = torch.arange(batch * nb, dtype=torch.long).view(batch, nb)
    lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, mc.num_heads, mc.head_dim)
    topk = torch.full((batch,), max(2, round(nb * ratio)), dtype=torch.long)
    selected = torch.empty(batch, mc.num_kv_heads, int(topk[0]), dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.float64)
    scale = mc.head_dim ** -0.5
    caches, summaries = runner.kv_caches, runner.sparse.summaries

    def dense():
        for c in caches:
            ext.paged_decode(q, c, tables, lens, bs, scale)

    def sparse():
        for c, s in zip(caches, summaries):
            ext.sparse_paged_decode(q, c, s, tables, lens, bs, scale, topk, selected, stats)

    return median_time(dense, repeat), median_time(sparse, repeat)


def speed(ratio: float, repeat: int) -> list[dict]:
    top = max(CONTEXTS)
    llm = LLM(sparse_topk_ratio=ratio, sparse_dense_layers=2, sparse_min_context=0,
              max_model_len=top, num_blocks=max(BATCHES) * top // 16 + 16, max_num_seqs=max(BATCHES))
    runner = llm.engine.executor.runner
    log("filling the KV cache with random values ...")
    for c in runner.kv_caches:
        c.normal_()
    runner.sparse.rebuild(runner.kv_caches, list(range(runner.num_blocks)))
    rows = []
    for ctx in CONTEXTS:
        for b in BATCHES:
            step_d = median_time(lambda: runner.execute(decode_steps(runner, b, ctx, False)), repeat)
            step_s = median_time(lambda: runner.execute(decode_steps(runner, b, ctx, True)), repeat)
            att_d, att_s = attention_time(runner, b, ctx, ratio, repeat)
            row = dict(context=ctx, batch=b, step_dense_ms=step_d * 1e3, step_sparse_ms=step_s * 1e3,
                       attn_dense_ms=att_d * 1e3, attn_sparse_ms=att_s * 1e3)
            rows.append(row)
            log(f"context {ctx:5d} batch {b}: step {row['step_dense_ms']:7.1f} -> "
                f"{row['step_sparse_ms']:7.1f} ms, attention {row['attn_dense_ms']:6.2f} -> "
                f"{row['attn_sparse_ms']:6.2f} ms ({att_d / att_s:.1f}x)")
    del llm
    return rows


def metadata(repeat: int) -> dict:
    """One 2,000-token request and 63 of 100 tokens, with a capacity of 8,192 tokens (512 blocks)."""
    llm = LLM(max_model_len=8192, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)
    runner = llm.engine.executor.runner
    lens = [2000] + [100] * 63
    steps, nxt = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // runner.block_size)
        r = Request(RequestId(f"m{i}"), [1] * n, SamplingParams(max_tokens=1), 1)
        steps.append(ScheduledRequest(r, n - 1, 1, tuple(range(nxt, nxt + nb)), True))
        nxt += nb
    out = SchedulerOutput(tuple(steps), len(steps))
    res = {}
    for name, adaptive in (("adaptive", True), ("capacity", False)):
        runner.buffers.adaptive = adaptive

        def build():
            layout, _ = runner._layout(out)
            runner.backend.build_metadata(layout)
            return layout

        layout = build()
        res[name] = dict(width=layout.block_tables.shape[1],
                         table_bytes=layout.block_tables.numel() * 8,
                         build_us=median_time(build, repeat) * 1e6)
        log(f"metadata {name}: width {res[name]['width']}, {res[name]['table_bytes']} table bytes, "
            f"{res[name]['build_us']:.0f} us to build")
    return res


def accuracy_at(ratio: float, block_size: int, start: int, positions: int) -> dict:
    """Teacher-forced agreement and perplexity, sparse K = ratio of the blocks against dense."""
    from tierserve.engine.eval.sparse import agreement, teacher_forced

    text = (ROOT / "tests" / "data" / "long_text.md").read_text()
    n = start + positions
    llm = LLM(sparse_topk_ratio=ratio, sparse_dense_layers=2, sparse_min_context=0,
              block_size=block_size, max_model_len=n + 16,
              num_blocks=2 * (n + 16) // block_size + 8)
    ids = llm.get_tokenizer().encode(text)[:n]
    t0 = time.perf_counter()
    dense, sparse = teacher_forced(
        llm.engine, ids, start, [False, True],
        progress=lambda i, k: i % 100 == 0 and log(f"  K={ratio:.4g}, block {block_size}: {i}/{k}"))
    st = llm.engine.executor.sparse_stats()
    row = dict(ratio=ratio, block_size=block_size, agreement=agreement(dense, sparse),
               ppl_dense=dense.perplexity, ppl_sparse=sparse.perplexity,
               attended=st.blocks_attended / st.blocks_total)
    log(f"K={ratio:.4g}, block size {block_size}: agreement {row['agreement']:.3f}, perplexity "
        f"{row['ppl_dense']:.2f} -> {row['ppl_sparse']:.2f}, blocks attended "
        f"{row['attended']:.3f} ({time.perf_counter() - t0:.0f} s)")
    return row


def accuracy(start: int, positions: int) -> list[dict]:
    """The curve over K at the engine's default block size (16)."""
    return [accuracy_at(ratio, 16, start, positions) for ratio in (1 / 16, 1 / 8, 1 / 4, 1 / 2)]


def granularity(ratio: float, start: int, positions: int) -> list[dict]:
    """K = ratio of the blocks at block sizes 4-32: the same share of tokens, chosen in finer or
    coarser pieces."""
    return [accuracy_at(ratio, bs, start, positions) for bs in (4, 8, 16, 32)]


def kernel_batches(batch: int, ctx: int, bs: int, shape: tuple[int, int, int]) -> list[tuple]:
    """Random batches for as many layers as make ~200 MB of cache at context 8192 (16 at batch 1),
    so the calls taking turns over them read their blocks cold."""
    from sparse_fixtures import random_batch

    layers = max(2, 16 // batch)
    return [random_batch([ctx] * batch, shape, bs, torch.float32, seed=l) for l in range(layers)]


def kernel_row(ext, batch: int, threads: int, layers: list[tuple], topk: int, reps: int,
               bs: int = 16) -> dict:
    """Median ms of one dense and one sparse decode call over `layers` in turn, on `threads`."""
    hkv, d = layers[0][1].shape[1], layers[0][0].shape[2]  # kv [2, Hkv, slots, D], q [B, H, D]
    turn = iter(range(1 << 30))
    stats = torch.zeros(2, dtype=torch.float64)
    selected = torch.empty(batch, hkv, topk, dtype=torch.int32)

    def dense():
        q, kv, _, tables, lens = layers[next(turn) % len(layers)]
        ext.paged_decode(q, kv, tables, lens, bs, d ** -0.5)

    def sparse():
        q, kv, summary, tables, lens = layers[next(turn) % len(layers)]
        ext.sparse_paged_decode(q, kv, summary, tables, lens, bs, d ** -0.5, topk, selected, stats)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t_dense, t_sparse = median_time(dense, reps), median_time(sparse, reps)
    finally:
        torch.set_num_threads(old)
    calls = (reps + 1) * batch * hkv  # median_time makes one warm-up call more
    return dict(batch=batch, threads=threads, dense_ms=t_dense * 1e3, sparse_ms=t_sparse * 1e3,
                speedup=t_dense / t_sparse, select_us_per_head=stats[1].item() / 1e3 / calls)


def kernel(repeat: int, ctx: int = 8192) -> list[dict]:
    """Dense against sparse decode attention, the kernels alone (was a printed timing in
    tests/test_sparse_kernel.py)."""
    from tierserve.kernels.native import load_extension

    ext = load_extension()
    if ext is None:
        raise SystemExit("the native extension could not be built here (see the log above)")
    bs, shape = 16, (9, 3, 64)
    rows = []
    for b in BATCHES:
        layers = kernel_batches(b, ctx, bs, shape)
        for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
            rows.append(kernel_row(ext, b, threads, layers, ctx // bs // 8, repeat * len(layers),
                                   bs))
            log(f"batch {b}, {threads} threads: dense {rows[-1]['dense_ms']:.3f} ms, sparse "
                f"{rows[-1]['sparse_ms']:.3f} ms")
    return rows


def print_kernel_table(rows: list[dict], ctx: int = 8192) -> None:
    from tables import markdown_table

    n = ctx // 16
    print(f"\n## decode attention alone, context {ctx}, block 16, topk {n // 8} of {n}, "
          f"H=9 Hkv=3 D=64, fp32\n")
    print(markdown_table(
        ("batch", "threads", "dense ms", "sparse ms", "speedup", "select us / head"), "rrrrrr",
        ([r["batch"], r["threads"], f"{r['dense_ms']:.3f}", f"{r['sparse_ms']:.3f}",
          f"{r['speedup']:.1f}x", f"{r['select_us_per_head']:.1f}"] for r in rows)))


def plot(result: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    n = 3 if result.get("accuracy") else 2
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2))
    for ax, (key, title) in zip(axes, (("attn", "decode attention, all layers"),
                                       ("step", "decode step, whole model"))):
        for b, style in zip(BATCHES, ("o-", "s--")):
            rows = [r for r in result["speed"] if r["batch"] == b]
            x = [r["context"] for r in rows]
            ax.plot(x, [r[f"{key}_dense_ms"] for r in rows], style, color="tab:gray",
                    label=f"dense, batch {b}")
            ax.plot(x, [r[f"{key}_sparse_ms"] for r in rows], style, color="tab:blue",
                    label=f"sparse K=1/{round(1 / result['ratio'])}, batch {b}")
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms", title=title)
        ax.set_xticks(CONTEXTS, [str(c) for c in CONTEXTS])
        ax.xaxis.set_minor_formatter(NullFormatter())
        lo = min(min(r[f"{key}_dense_ms"], r[f"{key}_sparse_ms"]) for r in result["speed"])
        hi = max(r[f"{key}_dense_ms"] for r in result["speed"])
        ax.set_yticks([t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                       if lo / 1.5 <= t <= hi * 1.5])
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    if n == 3:
        acc = result["accuracy"]
        ax = axes[2]
        x = [r["ratio"] for r in acc]
        ax.plot(x, [100 * r["agreement"] for r in acc], "o-", label="top-1 agreement (%)")
        ax.plot(x, [100 * (r["ppl_sparse"] / r["ppl_dense"] - 1) for r in acc], "s--",
                label="perplexity change (%)")
        ax.set(xscale="log", xlabel="K (share of blocks)", title="accuracy vs dense (2 dense layers)")
        ax.set_xticks(x, [f"1/{round(1 / r)}" for r in x])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axhline(95, color="tab:gray", lw=0.5)
        ax.legend(fontsize=8)
    fig.suptitle(result["machine"], fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sparse_decode.png", dpi=110)


def plot_granularity(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    x = [r["block_size"] for r in rows]
    ax.plot(x, [100 * r["agreement"] for r in rows], "o-", label="top-1 agreement (%)")
    ax.plot(x, [100 * (r["ppl_sparse"] / r["ppl_dense"] - 1) for r in rows], "s--",
            label="perplexity change (%)")
    ax.axhline(95, color="tab:gray", lw=0.5)
    ax.set(xscale="log", xlabel="KV block size (tokens)", ylabel="%",
           title=f"K = {rows[0]['ratio']:.2g} of the blocks, 2 dense layers")
    ax.set_xticks(x, [str(v) for v in x])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ratio", type=float, default=1 / 8, help="K as a share of the blocks")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs of each (default 5; --kernel: per layer's cache, default 4)")
    p.add_argument("--accuracy", action="store_true", help="also the accuracy curve over K")
    p.add_argument("--start", type=int, default=4000, help="accuracy: dense prefill tokens")
    p.add_argument("--positions", type=int, default=400, help="accuracy: decoded positions")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--replot", action="store_true", help="plot OUT/sparse.json again, no run")
    p.add_argument("--granularity", action="store_true",
                   help="only accuracy at K = 1/4 over block sizes 4-32 (OUT/sparse_granularity.json)")
    p.add_argument("--kernel", action="store_true",
                   help="only the attention kernels alone, dense against sparse (a table)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kernel:
        rows = kernel(4 if args.repeat is None else args.repeat)
        (args.out / "sparse_kernel.json").write_text(json.dumps(rows, indent=1))
        print_kernel_table(rows)
        return
    args.repeat = 5 if args.repeat is None else args.repeat
    if args.granularity:
        saved = args.out / "sparse_granularity.json"
        rows = (json.loads(saved.read_text()) if args.replot
                else granularity(0.25, args.start, args.positions))
        saved.write_text(json.dumps(rows, indent=1))
        plot_granularity(rows, args.out / "sparse_granularity.png")
        print(json.dumps(rows, indent=1))
        return
    if args.replot:
        plot(json.loads((args.out / "sparse.json").read_text()), args.out)
        return
    from tierserve.kernels.native import _cpu_info
    model = next((l.split(":", 1)[1].strip() for l in _cpu_info().splitlines()
                  if l.startswith("model name")), "cpu")
    result = dict(machine=f"{model}, {torch.get_num_threads()} threads", ratio=args.ratio,
                  speed=speed(args.ratio, args.repeat), metadata=metadata(args.repeat * 20))
    if args.accuracy:
        result["accuracy"] = accuracy(args.start, args.positions)
    (args.out / "sparse.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
