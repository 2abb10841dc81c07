"""The attention router: a table of devices and shapes against the expected backend and reasons,
overrides, the measured profile, `tierserve route` and GET /v1/backends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tierserve.kernels.profile import load_profile, save_profile
from tierserve.kernels.router import RouteQuery, route, route_phases
from tierserve.server.cli import main as cli_main

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ABSENT = lambda pkg: pkg != "flashinfer"  # noqa: E731  (FlashInfer not installed)
PRESENT = lambda pkg: True  # noqa: E731


def q(dev, cap, dtype, hd, h, hkv, kv="auto", page=16):
    return RouteQuery(dev, dtype, kv, hd, h, hkv, page, capability=cap)


# query, installed, expected (prefill, decode), expected reasons {backend: substring}
TABLE = [
    (q("cpu", None, F32, 64, 9, 3), ABSENT, ("cpu_native", "cpu_native"),
     {"triton": "device cpu not in", "torch_sdpa": "lower priority than cpu_native"}),
    (q("cpu", None, F32, 64, 9, 3, "fp8_e4m3"), ABSENT, ("torch_sdpa", "torch_sdpa"),
     {"cpu_native": "KV dtype fp8_e4m3 not in"}),
    (q("cpu", None, BF16, 64, 9, 3), ABSENT, ("torch_sdpa", "torch_sdpa"),
     {"cpu_native": "dtype bfloat16 not supported"}),
    (q("cuda", (7, 5), F16, 128, 32, 8), ABSENT, ("torch_sdpa", "torch_sdpa"),
     {"triton": "compute capability 7.5 below 8.0", "flashinfer": "not installed (flashinfer)"}),
    (q("cuda", (7, 5), BF16, 128, 32, 8), ABSENT, ("torch_ref", "torch_ref"),
     {"torch_sdpa": "bfloat16 needs compute capability 8.0 (have 7.5)"}),
    (q("cuda", (8, 0), BF16, 128, 32, 8), ABSENT, ("torch_sdpa", "triton"),
     {"flashinfer": "not installed (flashinfer)", "cpu_native": "device cuda not in"}),
    (q("cuda", (8, 0), BF16, 128, 32, 8, "fp8_e4m3"), ABSENT, ("torch_sdpa", "torch_sdpa"),
     {"triton": "fp8_e4m3 needs compute capability 8.9 (have 8.0)"}),
    (q("cuda", (8, 0), BF16, 128, 32, 8, "fp8_e4m3"), PRESENT, ("torch_sdpa", "torch_sdpa"),
     {"flashinfer": "fp8_e4m3 needs compute capability 8.9"}),
    (q("cuda", (8, 9), F16, 96, 16, 16, "fp8_e4m3"), ABSENT, ("torch_sdpa", "triton"), {}),
    (q("cuda", (9, 0), BF16, 128, 32, 8, "fp8_e4m3"), PRESENT, ("flashinfer", "flashinfer"),
     {"triton": "lower priority than flashinfer"}),
    (q("cuda", (9, 0), BF16, 96, 32, 8), PRESENT, ("torch_sdpa", "triton"),
     {"flashinfer": "head dim 96 not in (64, 128, 256)"}),
    (q("cuda", (9, 0), F32, 64, 12, 4), PRESENT, ("torch_sdpa", "triton"),
     {"flashinfer": "dtype float32 not supported"}),
    (q("cuda", (9, 0), F16, 256, 8, 8), ABSENT, ("torch_sdpa", "triton"), {}),
    (q("cuda", (10, 0), BF16, 256, 64, 8), PRESENT, ("flashinfer", "flashinfer"), {}),
    (q("cuda", (10, 0), BF16, 128, 24, 8), PRESENT, ("flashinfer", "flashinfer"), {}),
    (q("cuda", (10, 0), BF16, 128, 40, 8), PRESENT, ("torch_sdpa", "triton"),
     {"flashinfer": "GQA group 5 not in (1, 2, 3, 4, 8)"}),
    (q("cuda", (9, 0), BF16, 128, 32, 8, "float32"), PRESENT, ("torch_sdpa", "triton"),
     {"flashinfer": "KV dtype float32 not in"}),
]


@pytest.mark.parametrize("query,installed,expected,reasons", TABLE,
                         ids=[f"{t[0].device_type}-{t[0].capability}-{t[0].dtype}-d{t[0].head_dim}"
                              f"-g{t[0].group}-{t[0].kv_dtype}" for t in TABLE])
def test_route_table(query, installed, expected, reasons):
    routes = route_phases(query, installed=installed)
    assert (routes["prefill"].backend, routes["decode"].backend) == expected
    for r in routes.values():
        assert set(r.rejected) | {r.backend} == {"torch_sdpa", "torch_ref", "cpu_native", "triton",
                                                 "flashinfer"}  # every other one has a reason
    for name, why in reasons.items():
        assert any(why in r.rejected.get(name, "") for r in routes.values()), (name, routes)


def test_sparse_and_impossible_override_fail_with_reasons():
    sparse = RouteQuery("cpu", F32, "auto", 64, 9, 3, 16, sparse=True)
    chosen = route(sparse)  # only cpu_native runs sparse decode
    assert chosen.backend == "cpu_native"
    assert chosen.rejected["torch_sdpa"] == "no sparse attention support"
    cuda = RouteQuery("cuda", BF16, "auto", 128, 32, 8, 16, capability=(9, 0), sparse=True)
    on_gpu = route(cuda, installed=lambda p: True)  # triton runs sparse decode on CUDA
    assert on_gpu.backend == "triton"
    assert on_gpu.rejected["flashinfer"] == "no sparse attention support"
    old_gpu = RouteQuery("cuda", F32, "auto", 128, 32, 8, 16, capability=(7, 5), sparse=True)
    with pytest.raises(ValueError, match="triton: compute capability 7.5 below 8.0"):
        route(old_gpu, installed=lambda p: True)
    cpu = q("cpu", None, F32, 64, 9, 3)
    with pytest.raises(ValueError, match=r"triton cannot run prefill here: device cpu not in"):
        route_phases(cpu, "triton")
    with pytest.raises(ValueError, match="valid: torch_sdpa, torch_ref, cpu_native, triton"):
        route_phases(cpu, "nope")


def test_valid_override_and_per_phase_override():
    cpu = q("cpu", None, F32, 64, 9, 3)
    routes = route_phases(cpu, "prefill=torch_ref,decode=torch_sdpa")
    assert (routes["prefill"].backend, routes["decode"].backend) == ("torch_ref", "torch_sdpa")
    assert routes["decode"].basis == "override"


def test_profile_prefers_measured_fastest(tmp_path):
    cuda = q("cuda", (9, 0), BF16, 128, 32, 8)
    path = tmp_path / "p.json"
    save_profile(path, cuda.shape_key, {"decode": {"triton": 2.0, "torch_sdpa": 1.0},
                                        "prefill": {"torch_sdpa": 1.0, "triton": 0.95}})
    routes = route_phases(cuda, profile=load_profile(path), installed=ABSENT)
    assert routes["decode"].backend == "torch_sdpa" and routes["decode"].basis == "profile"
    assert routes["decode"].rejected["triton"].startswith("slower here (2 ms vs 1 ms")
    # within 10%: the priority list keeps its order
    assert routes["prefill"].backend == "torch_sdpa"
    assert "not >10% faster" in routes["prefill"].rejected["triton"]
    assert load_profile(tmp_path / "missing.json") == {}


def test_route_cli_json(capsys):
    rc = cli_main(["route", "--device", "cuda", "--capability", "9.0", "--dtype", "bfloat16",
                   "--head-dim", "128", "--num-heads", "32", "--num-kv-heads", "8",
                   "--kv-cache-dtype", "fp8_e4m3", "--profile", "/nonexistent", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["decode"]["backend"] in ("triton", "flashinfer")
    assert out["decode"]["rejected"]["cpu_native"] == "device cuda not in ('cpu',)"
    rc = cli_main(["route", "--device", "cpu", "--attention-backend", "flashinfer"])
    assert rc == 2 and "device cpu not in" in capsys.readouterr().err
    # --sparse: routed as the engine routes sparse top-k decode (decode only)
    rc = cli_main(["route", "--device", "cuda", "--capability", "9.0", "--dtype", "bfloat16",
                   "--head-dim", "128", "--num-heads", "32", "--num-kv-heads", "8",
                   "--profile", "/nonexistent", "--sparse", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["decode"]["backend"] == "triton"
    assert out["decode"]["rejected"]["torch_sdpa"] == "no sparse attention support"
    assert "no sparse" not in json.dumps(out["prefill"])


def test_backends_endpoint():
    from tierserve.engine.worker.device import DeviceChoice, DtypeChoice
    from tierserve.engine.info import EngineInfo, SparseStatus
    from tierserve.server.routes import backends
    routes = route_phases(q("cpu", None, F32, 64, 9, 3, "fp8_e4m3"))
    info = EngineInfo(model="m", max_model_len=2048, device=DeviceChoice("cpu", "auto: no GPU"),
                      dtype=DtypeChoice("float32", "auto: float32 on the CPU"),
                      kv_cache_dtype="float8_e4m3fn", backend="torch_sdpa", routes=routes,
                      sparse=SparseStatus(True, False, None, 0.25, 1024, 2), tiers=(),
                      events=None, tier_stats=None, policy_counters=None)
    app = FastAPI()
    app.state.ctx = SimpleNamespace(engine=SimpleNamespace(info=info))
    app.include_router(backends.router)
    body = TestClient(app).get("/v1/backends").json()
    assert (body["device"], body["device_reason"]) == ("cpu", "auto: no GPU")
    assert (body["dtype"], body["dtype_reason"]) == ("float32", "auto: float32 on the CPU")
    assert body["kv_cache_dtype"] == "float8_e4m3fn"
    assert body["decode"]["backend"] == "torch_sdpa"
    assert body["decode"]["rejected"]["cpu_native"].startswith("KV dtype fp8_e4m3")
    # configured, but torch_sdpa cannot run it: decodes stay dense, and the endpoint says so
    assert body["sparse_decode"]["enabled"] and not body["sparse_decode"]["active"]
    assert body["sparse_decode"]["topk_ratio"] == 0.25


def test_engine_refuses_impossible_backend():
    from tierserve.engine import LLM
    with pytest.raises(ValueError, match="flashinfer cannot run prefill here: device cpu"):
        LLM(attention_backend="flashinfer", kv_cache_memory_bytes=1 << 24)
