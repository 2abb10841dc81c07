"""Peak host memory while an engine loads a checkpoint, against a process that loads nothing.

    python bench/load_memory.py                      # ~0.5B Llama, bf16 safetensors, fp32 and bf16
    python bench/load_memory.py --layers 4           # a smoke run (~0.1B), under a minute
    python bench/load_memory.py --dir /tmp/ckpt      # keep (or reuse) the checkpoint there
    python bench/load_memory.py --tp 2               # also each rank's peak at TP=2

The checkpoint is a random-weight Llama written in bfloat16 (vocabulary 32000, hidden 1024,
16 query / 8 KV heads of 64, MLP 4096, untied embeddings, --layers 28: ~506M parameters, ~1 GB
on disk) in two safetensors files, with a word-level tokenizer.json. Each figure is one child
process's peak resident set (VmHWM in /proc/self/status, which counts the checkpoint pages it
maps too) after `LLM(model=dir, device="cpu", dtype=...)` returns:
- runtime: a child that imports torch and tierserve's engine and builds nothing;
- float32 / bfloat16: a child that builds the engine. Above the runtime, a streamed load should
  hold the weights in the serving dtype, nothing more (in float32 on the CPU the native kernel's
  packed panels are each linear's only copy: Linear.pack).
- with --tp N: each rank process's peak (VmHWM read from /proc by the child that started the
  ranks), against 1/N of the weights (the embedding and LM head are cut by vocabulary, every
  linear by heads or MLP width; norms are whole on every rank). A rank's runtime also holds
  torch.distributed's gloo group.
Each child also reports the seconds LLM() took (load_s). bench/gpu_check.py --checks uses the same
children with --device cuda: load time and peak host memory of a GPU load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def write_checkpoint(path: str, layers: int = 28, files: int = 2, seed: int = 0, vocab: int = 32000,
                     hidden: int = 1024, heads: int = 16, kv_heads: int = 8, head_dim: int = 64,
                     intermediate: int = 4096) -> dict:
    """A random bf16 Llama as a Hugging Face folder at `path`; returns its config.json. Written a
    file at a time, so the writer holds one file's tensors."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    q, kv = heads * head_dim, kv_heads * head_dim

    def linear(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=g) * (1.2 / inp ** 0.5)).bfloat16()

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.3 * torch.randn(n, generator=g)).bfloat16()

    per_file = -(-layers // files)
    for f in range(files):
        w = {}
        if f == 0:
            w["model.embed_tokens.weight"] = (torch.randn(vocab, hidden, generator=g) * 0.5).bfloat16()
        if f == files - 1:
            w["model.norm.weight"] = norm(hidden)
            w["lm_head.weight"] = linear(vocab, hidden)
        for i in range(f * per_file, min(layers, (f + 1) * per_file)):
            p = f"model.layers.{i}."
            w |= {p + "self_attn.q_proj.weight": linear(q, hidden),
                  p + "self_attn.k_proj.weight": linear(kv, hidden),
                  p + "self_attn.v_proj.weight": linear(kv, hidden),
                  p + "self_attn.o_proj.weight": linear(hidden, q),
                  p + "mlp.gate_proj.weight": linear(intermediate, hidden),
                  p + "mlp.up_proj.weight": linear(intermediate, hidden),
                  p + "mlp.down_proj.weight": linear(hidden, intermediate),
                  p + "input_layernorm.weight": norm(hidden),
                  p + "post_attention_layernorm.weight": norm(hidden)}
        save_file(w, os.path.join(path, f"model-{f + 1:05d}-of-{files:05d}.safetensors"),
                  metadata={"format": "pt"})
        del w
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    _write_tokenizer(path, vocab)
    return config


def _write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer over the words w0 .. w{vocab - 1} (ids 0-2: unk, bos, eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


def weight_bytes(config: dict, elem: int) -> tuple[int, int]:
    """(all weights, the linears' weights: decoder linears and the LM head) in bytes."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    v = config["vocab_size"]
    linears = n * (2 * h * q + 2 * h * kv + 3 * h * i) + v * h
    return elem * (linears + v * h + (2 * n + 1) * h), elem * linears


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def child(model: str | None, dtype: str, tp: int = 1, device: str = "cpu") -> None:
    """Build the engine (or, with no model, only import it) and print the peak as JSON; under
    tensor parallel, each rank process's peak (read from /proc while the ranks live)."""
    import time

    import torch
    from tierserve.engine import LLM

    ranks, load_s = [], 0.0
    if model is not None:
        t0 = time.perf_counter()
        llm = LLM(model=model, device=device, dtype=dtype, kv_cache_memory_bytes=4 << 20,
                  max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_threads=tp,
                  tensor_parallel_size=tp)
        load_s = time.perf_counter() - t0
        if tp > 1:
            ranks = [peak_of(p.pid) for p in llm.engine.executor._procs]
    elif device.startswith("cuda"):  # the runtime of a GPU load holds a CUDA context too
        torch.zeros(1, device=device)
    print(json.dumps({"peak": peak_bytes(), "ranks": ranks, "load_s": load_s}), flush=True)


def measure(model: str | None, dtype: str = "float32", tp: int = 1, device: str = "cpu") -> dict:
    """A fresh child's peak resident bytes, and its ranks' under tensor parallel (see child)."""
    args = [sys.executable, os.path.abspath(__file__), "--child", model or "", "--dtype", dtype,
            "--tp", str(tp), "--device", device]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dir", default=None, help="checkpoint folder (written if it has no config)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tp", type=int, default=1,
                    help="also load at this tensor parallel size: each rank's peak")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child or None, a.dtype, a.tp, a.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.dir or os.path.join(tmp, "ckpt")
        cfg_path = os.path.join(path, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
        else:
            config = write_checkpoint(path, layers=a.layers)
        params = weight_bytes(config, 1)[0]
        print(f"checkpoint: {params / 1e6:.0f}M parameters, bf16 on disk "
              f"{2 * params / 2**30:.2f} GiB ({path})")
        runtime = measure(None)["peak"]
        print(f"{'load':<18} {'peak GiB':>9} {'above runtime':>14} {'weights':>8} "
              f"{'ratio':>6}")
        print(f"{'runtime':<18} {runtime / 2**30:>9.2f}")
        for dtype in a.dtypes.split(","):
            elem = 4 if dtype == "float32" else 2
            weights = weight_bytes(config, elem)[0]
            rows = [(dtype, measure(path, dtype)["peak"], 1)]
            if a.tp > 1:
                rows += [(f"{dtype} rank {r}/{a.tp}", p, a.tp)
                         for r, p in enumerate(measure(path, dtype, a.tp)["ranks"])]
            for name, peak, n in rows:
                above = peak - runtime
                print(f"{name:<18} {peak / 2**30:>9.2f} {above / 2**30:>14.2f} "
                      f"{weights / n / 2**30:>8.2f} {above / (weights / n):>6.2f}")


if __name__ == "__main__":
    main()
