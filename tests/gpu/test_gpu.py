"""GPU tests: the checks of bench/gpu_check.py as assertions, skipped without CUDA (CI has no GPU).
On a GPU node: `pytest tests/gpu` (the timings and the server run stay in the script:
`python bench/gpu_check.py --serve --graphs --sparse --checks`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_backends_match_torch_ref(gc):
    """Every CUDA backend valid here against torch_ref, bf16, decode and mixed batches, fp8 KV
    too: relative error below 1e-2."""
    rows = gc.kernel_checks("cuda", torch.bfloat16, tiny=False)
    assert rows and all(r[5] for r in rows), [r for r in rows if not r[5]]


def test_routed_engine_agrees_with_torch_sdpa(gc):
    """Random-weight models of the embedded model's and Llama-3-8B's shapes: the routed backends'
    greedy tokens against torch_sdpa's (bf16 may flip a near-tie: 90% or more)."""
    rows = gc.engine_checks("cuda", "bfloat16", tiny=False)
    agreement = [r[2] for r in rows if "greedy agreement" in r[1]]
    assert len(agreement) == 2 and min(agreement) >= 0.9, rows


def test_cuda_graph_decode_replays_and_agrees(gc):
    rows = gc.graph_decode("cuda", "bfloat16", tiny=False)
    assert all(replayed > 0 for *_, replayed, _ in rows), rows
    assert all(same >= 0.9 for *_, same in rows), rows


def test_triton_sparse_decode(gc):
    """The Triton sparse decode against the torch oracle, bit-equal to dense where K covers every
    block; the engine's greedy tokens with K covering every block equal dense's."""
    rows = gc.sparse_kernel_checks("cuda", torch.bfloat16, tiny=False)
    assert all(r[-1] for r in rows), rows
    engine = dict(gc.sparse_engine("cuda", "bfloat16", tiny=False))
    assert engine["greedy tokens, K covering every block = dense"] == 1.0


def test_sparse_decode_replays_in_cuda_graphs(gc):
    """Sparse decode (K = 1/8) captured in CUDA graphs: steps replay and the greedy tokens agree
    with eager sparse decode."""
    *_, replayed, same = gc.sparse_graphs("cuda", "bfloat16", tiny=False)
    assert replayed > 0 and same >= 0.9
