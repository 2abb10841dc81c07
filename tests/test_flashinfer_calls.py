"""kernels/flashinfer_attn.py against a stand-in `flashinfer` (no GPU, no FlashInfer here): a
module put in sys.modules whose two wrappers record every call and compute paged attention from
exactly what plan() was given, in torch, so the answer matches the torch_ref oracle only if the
page table handed over is right.

The calls follow FlashInfer 0.7.4's API (decode.py, prefill.py) and what it asks of callers:
- plan() gets host tensors: it calls .to("cpu") on indptr and last_page_len and copies the
  indices to the device itself, so device tensors would only be copied back (a sync each);
- run() gets out=, our output rows, instead of a new tensor copied over per layer;
- decode uses tensor cores from a GQA group of 4;
- the workspace buffer is zeroed ("must be initialized to 0 for its first use").
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from tierserve.kernels import flashinfer_attn
from tierserve.kernels.bench import make_batch, rel_err, run_backend


class Wrapper:
    """Records its construction and each plan() / run(); run() attends over the planned pages."""

    calls: list[tuple[str, str, tuple, dict]] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs):
        self.record("__init__", (workspace, kv_layout), kwargs)
        self.plan_args: tuple | None = None

    @classmethod
    def record(cls, method: str, args: tuple, kwargs: dict) -> None:
        Wrapper.calls.append((cls.__name__, method, args, kwargs))

    def _plan(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
              page_size, **kwargs):
        self.plan_args = (qo_indptr, indptr, indices, last, num_qo_heads // num_kv_heads,
                          kwargs["sm_scale"], kwargs.get("causal", False))

    def run(self, q, paged_kv, out=None, **kwargs):
        self.record("run", (q, paged_kv), dict(kwargs, out=out))
        qo_indptr, indptr, indices, last, group, scale, causal = self.plan_args
        k_pages, v_pages = paged_kv  # HND: [blocks, Hkv, page, D]
        result = torch.empty_like(q) if out is None else out
        for i in range(len(last)):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            length = (len(pages) - 1) * k_pages.shape[2] + int(last[i])
            k, v = ((p[pages].transpose(0, 1).reshape(p.shape[1], -1, p.shape[3])[:, :length])
                    .repeat_interleave(group, 0) for p in (k_pages, v_pages))
            rows = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
            s = torch.einsum("qhd,hkd->hqk", q[rows].float(), k.float()) * scale
            if causal:
                pos = torch.arange(length - s.shape[1], length).unsqueeze(1)
                s = s.masked_fill(torch.arange(length).unsqueeze(0) > pos, -math.inf)
            result[rows] = torch.einsum("hqk,hkd->qhd", s.softmax(-1), v.float()).to(q.dtype)
        return result


class BatchDecodeWithPagedKVCacheWrapper(Wrapper):
    def plan(self, indptr, indices, last_page_len, *args, **kwargs):
        self.record("plan", (indptr, indices, last_page_len, *args), kwargs)
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, *args, **kwargs)


class BatchPrefillWithPagedKVCacheWrapper(Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, *args, **kwargs):
        self.record("plan", (qo_indptr, indptr, indices, last_page_len, *args), kwargs)
        self._plan(qo_indptr, indptr, indices, last_page_len, *args, **kwargs)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str, tuple, dict]]:
    stub = types.ModuleType("flashinfer")
    stub.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    stub.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", stub)
    monkeypatch.setattr(flashinfer_attn, "WORKSPACE_BYTES", 4096)
    Wrapper.calls = []
    return Wrapper.calls


def backend(h: int, hkv: int, d: int) -> flashinfer_attn.FlashInferBackend:
    return flashinfer_attn.FlashInferBackend(h, hkv, d, 1 / math.sqrt(d), device="cpu",
                                             dtype=torch.float32)


def of(calls, method: str, cls: str | None = None) -> list[tuple]:
    return [c for c in calls if c[1] == method and (cls is None or c[0] == cls)]


# a mixed step: decodes first, then a fresh prompt and a chunk after cached tokens
MIXED = [(1, 1), (1, 17), (1, 40), (7, 7), (6, 30)]


@pytest.mark.parametrize("shape", [(4, 4, 64, 16), (8, 2, 64, 16), (16, 2, 128, 32)],
                         ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}p{s[3]}")
def test_answers_match_the_oracle_from_host_page_tables(calls, shape):
    h, hkv, d, bs = shape
    inputs = make_batch(MIXED, h, hkv, d, bs)
    ref = run_backend("torch_ref", *inputs)
    be = backend(h, hkv, d)
    # the KV cache's device stands for the GPU: an index tensor moved there before plan() would
    # show up on it (and the stand-in could not read it back)
    be.device = torch.device("meta")
    assert rel_err(run_backend(be, *inputs), ref) < 1e-5
    plans = of(calls, "plan")
    assert [c[0] for c in plans] == ["BatchDecodeWithPagedKVCacheWrapper",
                                     "BatchPrefillWithPagedKVCacheWrapper"]
    for _, _, args, _ in plans:
        index_tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert len(index_tensors) in (3, 4)
        for t in index_tensors:  # host int32 (pinned under CUDA), never a device round trip
            assert t.device.type == "cpu" and t.dtype == torch.int32


def test_run_writes_into_the_output_rows(calls):
    q, k, v, cache, layout = make_batch(MIXED, 8, 2, 64, 16)
    be = backend(8, 2, 64)
    out = run_backend(be, q, k, v, cache, layout)
    runs = of(calls, "run")
    assert len(runs) == 2
    n = layout.num_decodes
    for (_, _, (rq, _), kwargs), rows in zip(runs, (slice(0, n), slice(n, None))):
        given = kwargs["out"]
        assert given is not None and given.is_contiguous() and given.shape == rq.shape
        # the rows run() wrote are the rows forward() returned: no copy in between
        assert given.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert given.data_ptr() == out.view(q.shape)[rows].data_ptr()


@pytest.mark.parametrize("h,hkv,tensor_cores", [(4, 4, False), (6, 2, False), (8, 2, True),
                                                (16, 2, True), (12, 4, False), (32, 8, True)])
def test_decode_takes_tensor_cores_from_group_4(calls, h, hkv, tensor_cores):
    backend(h, hkv, 64)
    (decode,) = of(calls, "__init__", "BatchDecodeWithPagedKVCacheWrapper")
    assert decode[3].get("use_tensor_cores", False) is tensor_cores
    assert decode[2][1] == "HND"


def test_the_workspace_starts_zeroed(calls, monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(7)
                        if k.get("dtype") is torch.uint8 else real_empty(*a, **k))
    backend(8, 2, 64)
    inits = of(calls, "__init__")
    assert len(inits) == 2
    (workspace,) = {id(c[2][0]): c[2][0] for c in inits}.values()  # one buffer, shared
    assert workspace.dtype == torch.uint8 and workspace.numel() == flashinfer_attn.WORKSPACE_BYTES
    assert not workspace.any()
