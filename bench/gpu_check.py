"""GPU check: CUDA attention backends against torch_ref, the engine end to end on random-weight
models (the embedded model's shape and Llama-3-8B's), and 8B decode tok/s at batch 1/32/128
against the memory-bandwidth roofline. Needs only torch and triton (and numpy, which the engine's
runner imports); FlashInfer is checked when installed. Prints markdown tables.

    python bench/gpu_check.py                    # on the GPU machine, < 8 minutes on an H200
    python bench/gpu_check.py --device cpu --tiny  # dry run of the same logic (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "engine" not in sys.modules:  # skip engine/__init__ (tokenizers, gguf, jinja2): runner only
    pkg = types.ModuleType("engine")
    pkg.__path__ = [str(ROOT / "engine")]
    sys.modules["engine"] = pkg

import torch  # noqa: E402

from tierserve.engine.block_pool import BlockPool  # noqa: E402
from tierserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tierserve.engine.model_runner import ModelRunner  # noqa: E402
from tierserve.engine.request import Request, RequestId, RequestStatus  # noqa: E402
from tierserve.engine.sampling_params import SamplingParams  # noqa: E402
from tierserve.engine.scheduler import Scheduler  # noqa: E402
from tierserve.kernels.bench import make_batch, rel_err, run_backend  # noqa: E402
from tierserve.kernels.router import RouteQuery, route_phases  # noqa: E402

SHAPES = {  # name: ModelConfig of a Llama-family model (random weights)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32),
}
HBM_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def kernel_checks(device: str, dtype: torch.dtype, tiny: bool) -> list[tuple]:
    """(backend, shape, phase mix, kv dtype, rel err, ok) for every backend valid here."""
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    shapes = [(9, 3, 64, 16), (32, 8, 128, 16), (16, 16, 96, 32), (64, 8, 256, 16)]
    batches = {"decode": [(1, 7), (1, 300), (1, 1030)],
               "mixed": [(1, 40), (1, 513), (200, 200), (77, 600)]}
    if tiny:
        shapes, batches = shapes[:1], {"mixed": [(1, 7), (1, 40), (9, 9), (5, 30)]}
    rows = []
    for h, hkv, d, page in shapes:
        for kv in ("auto", "fp8_e4m3"):
            q = RouteQuery(device, dtype, kv, d, h, hkv, page, capability=cap)
            names = {r.backend for r in route_phases(q).values()}
            names |= {n for r in route_phases(q).values() for n, why in r.rejected.items()
                      if why.startswith("lower priority")}
            for mix, seqs in batches.items():
                if kv == "fp8_e4m3":  # a fresh prompt in torch_sdpa attends to unquantized K/V
                    seqs = [(ql, ctx) for ql, ctx in seqs if ql == 1 or ql < ctx]
                inputs = make_batch(seqs, h, hkv, d, page, kv, dtype, device)
                ref = run_backend("torch_ref", *inputs)
                for name in sorted(names - {"torch_ref", "cpu_native"}):
                    err = rel_err(run_backend(name, *inputs), ref)
                    rows.append((name, f"h{h}/kv{hkv}/d{d}/p{page}", mix, kv, err, err < tol))
    return rows


def random_weights(cfg: ModelConfig, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "lm_head.weight": w(cfg.vocab_size, h),
           "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": w(cfg.q_size, h),
                p + "self_attn.k_proj.weight": w(cfg.kv_size, h),
                p + "self_attn.v_proj.weight": w(cfg.kv_size, h),
                p + "self_attn.o_proj.weight": w(h, cfg.q_size),
                p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i),
                p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype)}
    return out


class MiniEngine:
    """Scheduler + block pool + runner on token ids: the engine's step loop without a tokenizer."""

    def __init__(self, cfg: ModelConfig, weights, device: str, dtype: str, backend: str | None,
                 num_blocks: int, max_seqs: int, max_len: int):
        self.config = EngineConfig(model="random", dtype=dtype, device=device,
                                   attention_backend=backend,
                                   cache=CacheConfig(num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=4096,
                                                             max_num_seqs=max_seqs,
                                                             max_model_len=max_len))
        self.pool = BlockPool(num_blocks, 16, False)
        self.sched = Scheduler(self.config.scheduler, self.pool, lambda r: b"")
        self.runner = ModelRunner(self.config, cfg, weights, num_blocks, max_len)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list]:
        """Greedy outputs, and (batch, seconds) of every decode-only step."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = [Request(RequestId(str(i)), p, params, max_tokens) for i, p in enumerate(prompts)]
        for r in reqs:
            self.sched.add_request(r)
        steps = []
        while any(not r.status.finished for r in reqs):
            out = self.sched.schedule()
            sync()
            t0 = time.perf_counter()
            res = self.runner.execute(out)
            sync()
            if all(s.num_new_tokens == 1 for s in out.scheduled):
                steps.append((len(out.scheduled), time.perf_counter() - t0))
            self.sched.update(out, res.sampled)
            done = [r.request_id for r in reqs
                    if not r.status.finished and len(r.output_token_ids) >= max_tokens]
            self.sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
        return [r.output_token_ids for r in reqs], steps


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_checks(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """Per model shape: greedy agreement of the routed backend with torch_sdpa, and tok/s."""
    rows = []
    for name in (["tiny"] if tiny else ["smollm2-135m", "llama-3-8b"]):
        cfg = ModelConfig(architecture="llama", **SHAPES[name])
        weights = random_weights(cfg, device, getattr(torch, dtype))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(cfg.vocab_size, (n,), generator=g).tolist()
                   for n in ([5, 17, 40, 3] if tiny else [7, 100, 333, 900, 31, 64, 512, 1])]
        outs = {}
        for backend in (None, "torch_sdpa"):
            eng = MiniEngine(cfg, weights, device, dtype, backend, 512, 16, 2048)
            t0 = time.perf_counter()
            outs[backend], _ = eng.generate(prompts, 8 if tiny else 32)
            secs = time.perf_counter() - t0
            label = eng.runner.backend.name if backend is None else backend
            rows.append((name, label, sum(map(len, outs[backend])) / secs))
            del eng
        same = sum(a == b for x, y in zip(outs[None], outs["torch_sdpa"]) for a, b in zip(x, y))
        total = sum(map(len, outs[None]))
        rows.append((name, "greedy agreement routed vs torch_sdpa", same / total))
        del weights
    return rows


def decode_throughput(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """(batch, context, tok/s, roofline tok/s) for the 8B shape (tiny in a dry run)."""
    name = "tiny" if tiny else "llama-3-8b"
    cfg = ModelConfig(architecture="llama", **SHAPES[name])
    weights = random_weights(cfg, device, getattr(torch, dtype))
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    weight_bytes = sum(w.numel() for w in weights.values()) * elem
    ctx, new = (32, 4) if tiny else (512, 16)
    batches = [1, 4] if tiny else [1, 32, 128]
    blocks = max(batches) * (-(-(ctx + new) // 16)) + 8
    eng = MiniEngine(cfg, weights, device, dtype, None, blocks, max(batches), ctx + new + 16)
    del weights
    bw = HBM_BYTES_PER_S.get(torch.cuda.get_device_name() if device == "cuda" else "", 0.0)
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % cfg.vocab_size for j in range(ctx)] for i in range(b)]
        _, steps = eng.generate(prompts, new)
        steps = steps[2:] or steps  # warm-up (compiles) excluded
        tok_s = sum(n for n, _ in steps) / sum(s for _, s in steps)
        kv = b * (ctx + new // 2) * cfg.kv_bytes_per_token(elem)
        roof = b * bw / (weight_bytes + kv) if bw else float("nan")
        rows.append((b, ctx, tok_s, roof))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes: a dry run of the logic")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()
    print(f"# gpu_check on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, flashinfer "
          f"{'installed' if importlib.util.find_spec('flashinfer') else 'absent'}\n")
    rows = kernel_checks(args.device, getattr(torch, dtype), args.tiny)
    print("| backend | shape | batch | KV | rel err vs torch_ref | ok |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2e} | {'yes' if r[5] else 'NO'} |")
    print(f"\n| model | backend | tok/s (mixed batch, end to end) |\n|---|---|---|")
    for r in engine_checks(args.device, dtype, args.tiny):
        print(f"| {r[0]} | {r[1]} | {r[2]:.3g} |")
    print("\n| batch | context | decode tok/s | roofline tok/s | % |\n|---|---|---|---|---|")
    for b, ctx, tps, roof in decode_throughput(args.device, dtype, args.tiny):
        print(f"| {b} | {ctx} | {tps:.1f} | {roof:.1f} | {100 * tps / roof:.0f} |")
    print(f"\ntotal {time.time() - t0:.0f} s")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
