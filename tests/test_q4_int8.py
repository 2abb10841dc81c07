"""The 4-bit x int8 linear (kernels/csrc/q4_int8.cpp): its integer arithmetic exact on the rounded
activations, its distance from the fp32 product no more than rounding x to int8 explains (and a
wrong packing far off, so the check can fail), and a row's result the same bits whatever batch or
thread split it runs in."""

from __future__ import annotations

import pytest
import torch

from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.worker.quant import GROUP, blocks_to_groups
from tierserve.kernels.native import load_extension

ext = load_extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the native extension could not be built here")

REAL = ["model.layers.0.self_attn.q_proj.weight", "model.layers.15.mlp.gate_proj.weight",
        "model.layers.29.mlp.down_proj.weight"]


def _random_q4(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Q4_1-like fields: codes [n, k] uint8 0..15, d and m [n, k / 32] with m near -8 d."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 0.002
    m = -8 * d * (0.8 + 0.4 * torch.rand(n, k // GROUP, generator=gen))
    return q, d, m


@pytest.fixture(scope="module")
def real() -> dict[str, tuple[torch.Tensor, ...]]:
    """The embedded SmolLM2-135M's Q4_1 blocks as (codes, d, m)."""
    blocks = load_model_source("smollm2-135m").blocks
    out = {}
    for name in REAL:
        g = blocks_to_groups(blocks[name])
        out[name] = (g.codes.to(torch.uint8), g.scale, g.offset)
    return out


def _exact(x, q, d, m, bias=None) -> torch.Tensor:
    """float64 y from q8_quantize's (xq, dx, sx) and the unit's fp16 d, m: what the kernel's
    integer sums and fp32 steps approximate to fp32 rounding."""
    xq, dx, sx = ext.q8_quantize(x)
    rows, k = x.shape
    n = q.shape[0]
    isum = torch.einsum("mbk,nbk->mnb", xq.double().view(rows, -1, GROUP),
                        q.double().view(n, -1, GROUP))
    dh, mh = d.half().double(), m.half().double()
    y = (isum * dx.double()[:, None] * dh[None]).sum(-1) + sx.double() @ mh.t()
    return y if bias is None else y + bias.double()


def _fp32(x, q, d, m) -> torch.Tensor:
    n, k = q.shape
    w = (q.float().view(n, -1, GROUP) * d[..., None] + m[..., None]).view(n, k)
    return x @ w.t()


def _row_err(y, ref) -> float:
    """Worst row's max |error| over that row's max |ref|."""
    return float(((y.double() - ref).abs().amax(1) / ref.abs().amax(1)).max())


def _norm_err(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("n,k", [(40, 576), (40, 1536), (8, 32), (200, 96)])
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_integer_arithmetic_is_exact(n, k, rows, with_bias):
    """N not a multiple of 16 (the last group's rows past N are padding and never written)."""
    q, d, m = _random_q4(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n) if with_bias else None
    y = ext.q4i8_linear(x, ext.q4i8_pack(q, d, m), n, bias=bias)
    assert y.shape == (rows, n)
    assert _row_err(y, _exact(x, q, d, m, bias)) < 1e-5


@pytest.mark.parametrize("name", REAL)
def test_real_weights_exact_and_close_to_fp32(real, name):
    """The model's own blocks: exact on the rounded x, and within the rounding of x of the fp32
    product, also with outlier channels (one large value sets its block's scale)."""
    q, d, m = real[name]
    packed = ext.q4i8_pack(q, d, m)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, q.shape[1], generator=gen)
    y = ext.q4i8_linear(x, packed, q.shape[0])
    assert _row_err(y, _exact(x, q, d, m)) < 1e-5
    assert _norm_err(y, _fp32(x, q, d, m)) < 1e-2
    x[:, torch.randperm(q.shape[1], generator=gen)[:4]] *= 30
    assert _norm_err(ext.q4i8_linear(x, packed, q.shape[0]), _fp32(x, q, d, m)) < 2e-2


def test_a_wrong_packing_is_far_off(real):
    q, d, m = real[REAL[1]]
    n, k = q.shape
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
    ref = _fp32(x, q, d, m)
    packed = ext.q4i8_pack(q, d, m)
    swapped = packed.view(-1, k // GROUP, 2, 160).flip(2).reshape(packed.shape).contiguous()
    other_rows = ext.q4i8_pack(q.roll(1, 0).contiguous(), d, m)  # each row another's codes
    assert _norm_err(ext.q4i8_linear(x, packed, n), ref) < 1e-2
    assert _norm_err(ext.q4i8_linear(x, swapped, n), ref) > 0.3
    assert _norm_err(ext.q4i8_linear(x, other_rows, n), ref) > 0.3


def test_q8_quantize_rounds_each_block_to_nearest():
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3)) * 4
    x[2, 64:96] = 0  # an all-zero block
    xq, dx, sx = ext.q8_quantize(x)
    assert xq.dtype == torch.int8 and dx.shape == sx.shape == (5, 576 // GROUP)
    blocks = xq.view(5, -1, GROUP)
    step = dx.double()[..., None]
    err = (x.double().view(5, -1, GROUP) - blocks.double() * step).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(sx, dx * blocks.sum(-1).float())
    assert blocks.abs().amax(-1)[dx > 0].eq(127).all()  # each block's largest value is +-127
    assert dx[2, 2] == 0 and sx[2, 2] == 0 and not blocks[2, 2].any()
    assert torch.isfinite(dx).all() and torch.isfinite(sx).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(with_bias):
    q, d, m = _random_q4(200, 576, seed=4)
    packed = ext.q4i8_pack(q, d, m)
    bias = torch.randn(200) if with_bias else None
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(4))
    full = ext.q4i8_linear(x, packed, 200, bias=bias)
    for rows in [*range(1, 10), 64]:
        assert torch.equal(ext.q4i8_linear(x[:rows], packed, 200, bias=bias), full[:rows])
    for r in (0, 5, 63):
        assert torch.equal(ext.q4i8_linear(x[r:r + 1], packed, 200, bias=bias)[0], full[r])


def test_the_thread_split_does_not_change_the_result():
    """The pool takes torch's thread count: 1, 2 and 3 threads cut the 60 groups differently."""
    q, d, m = _random_q4(960, 576, seed=5)
    packed = ext.q4i8_pack(q, d, m)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        ys = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ys.append(ext.q4i8_linear(x, packed, 960))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


def test_bad_arguments_are_named():
    q, d, m = _random_q4(40, 64, seed=6)
    packed = ext.q4i8_pack(q, d, m)
    with pytest.raises(RuntimeError, match="holds 3 groups"):
        ext.q4i8_linear(torch.randn(1, 64), packed, 56)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weights 64"):
        ext.q4i8_linear(torch.randn(1, 32), packed, 40)
    with pytest.raises(RuntimeError, match="codes must be 0..15"):
        ext.q4i8_pack(q + 16, d, m)
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.q4i8_pack(q, d * 1e7, m)
