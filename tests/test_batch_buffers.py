"""Fixed-capacity step buffers and their per-batch views (engine/worker/batch_buffers.py): the width rule,
shapes, strides and padding the backends see, and that steady-state steps allocate nothing."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierserve.engine.worker.batch_buffers import PAD_BLOCK, BatchBuffers, active_width
from tierserve.engine.llm import LLM
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput


class CountAllocations(TorchDispatchMode):
    """Counts aten ops that make new storage (factories, copies to new tensors)."""

    MAKERS = ("empty", "zeros", "ones", "full", "arange", "clone", "_to_copy", "lift_fresh",
              "scalar_tensor", "new_", "cat", "stack", "repeat", "index_select", "index.Tensor")

    def __init__(self):
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if any(name.startswith(m) for m in self.MAKERS):
            self.made.append(name)
        return func(*args, **(kwargs or {}))


def test_width_rule():
    assert active_width(100, 256, 8) == 128
    assert active_width(1, 256, 8) == 8
    assert active_width(8, 256, 8) == 8
    assert active_width(9, 256, 8) == 16
    assert active_width(129, 256, 8) == 256
    assert active_width(200, 200, 8) == 200  # capped by capacity, not rounded past it


def test_views_capacity_256_longest_100():
    buf = BatchBuffers(max_num_seqs=8, max_num_tokens=512, capacity_blocks=256, num_kv_heads=3)
    tables_ptr = buf.tables.data_ptr()
    decodes = [tuple(range(100)), tuple(range(300, 340))]
    prefill = [tuple(range(500, 503))]
    view = buf.table_view(decodes + prefill)
    assert view.shape == (3, 128) and view.stride() == (128, 1) and view.is_contiguous()
    assert view.data_ptr() == tables_ptr  # a view of the buffer, not a copy
    assert view[0, :100].tolist() == list(range(100))
    assert (view[0, 100:] == PAD_BLOCK).all() and (view[1, 40:] == PAD_BLOCK).all()
    assert view[2, :3].tolist() == [500, 501, 502] and (view[2, 3:] == PAD_BLOCK).all()
    # The backends' decode and prefill parts (kernels.base.BatchLayout) are row slices: contiguous.
    dec, pre = view[:2], view[2:]
    assert dec.shape == (2, 128) and dec.is_contiguous() and dec.stride() == (128, 1)
    assert pre.shape == (1, 128) and pre.is_contiguous() and pre.data_ptr() == tables_ptr + 2 * 128 * 8
    sel = buf.selected_view(2, 16)
    assert sel.shape == (2, 3, 16) and sel.is_contiguous() and sel.data_ptr() == buf.selected.data_ptr()
    with pytest.raises(ValueError, match="capacity is 256"):
        buf.table_view([tuple(range(257))])


def test_width_follows_batch_up_and_down():
    buf = BatchBuffers(max_num_seqs=4, max_num_tokens=64, capacity_blocks=256, num_kv_heads=3)
    tables = buf.tables  # held, so no new buffer can take its address
    widths = []
    for longest in (3, 20, 100, 250, 100, 9, 1):
        view = buf.table_view([tuple(range(longest)), (7,)])
        widths.append(view.shape[1])
        assert view.data_ptr() == buf.tables.data_ptr() == tables.data_ptr()  # never reallocated
    assert widths == [8, 32, 128, 256, 128, 16, 8]
    fixed = BatchBuffers(4, 64, 256, 3, adaptive=False)
    assert fixed.table_view([(1, 2)]).shape == (1, 256)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=4096, num_blocks=600, max_num_seqs=8)


def _step(runner, reqs):
    """A hand-made step: each (prompt length, tokens this step) pair as one request."""
    sched = []
    next_block = 0
    for i, (start, n) in enumerate(reqs):
        blocks = -(-(start + n) // runner.block_size)
        ids = tuple(range(next_block, next_block + blocks))
        next_block += blocks
        r = Request(RequestId(f"r{i}"), [1] * (start + n), SamplingParams(max_tokens=1), 1)
        sched.append(ScheduledRequest(r, start, n, ids, True))
    return SchedulerOutput(tuple(sched), sum(n for _, n in reqs))


def _data_ptrs(attrs: dict) -> dict[str, int]:
    """Where each tensor among the attributes lives: reallocated (or replaced), it moves."""
    return {name: t.data_ptr() for name, t in attrs.items() if isinstance(t, torch.Tensor)}


def test_runner_layout_uses_buffers_without_allocating(llm):
    runner = llm.engine.executor.runner
    buf = runner.buffers
    held = dict(vars(buf))  # the buffers, kept alive: no new one can take their addresses
    widths = []
    for reqs in ([(1599, 1), (30, 1), (0, 40)], [(120, 1), (40, 1)], [(3000, 1), (5, 1)],
                 [(10, 1)]):
        out = _step(runner, reqs)
        with CountAllocations() as counter:
            layout, _ = runner._layout(out)
        assert counter.made == [], counter.made
        assert layout.block_tables.data_ptr() == buf.tables.data_ptr()
        assert layout.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()
        widths.append(layout.block_tables.shape[1])
        for i, (start, n) in enumerate(reqs):
            blocks = -(-(start + n) // runner.block_size)
            assert (layout.block_tables[i, blocks:] == PAD_BLOCK).all()
            assert (layout.block_tables[i, :blocks] >= 0).all()
    # 100 blocks -> 128, 8 -> 8 (the alignment), 188 -> 256, 1 -> 8
    assert widths == [128, 8, 256, 8]
    assert _data_ptrs(vars(buf)) == _data_ptrs(held)  # four batch shapes reallocated no buffer


def test_engine_steps_report_width_and_bytes(llm):
    out = llm.generate(["hello " * 300], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3
    st = llm.engine.stats
    assert st.table_width.total > 0 and st.metadata_bytes.total > 0
    # the 300-word prompt needs ~19-38 blocks: every step's width is 32 or 64 (powers of two)
    widths = {b for b, c in zip(st.table_width.bounds, st.table_width.counts) if c}
    assert widths <= {8, 16, 32, 64, 128, 256}, widths


def test_pinned_buffers_are_not_rewritten_while_a_copy_may_read_them(llm, monkeypatch):
    """On a GPU the step's uploads from the pinned buffers are asynchronous: each step records an
    event after them, and the next step's layout waits for it before writing (steps that do not
    sample never sync otherwise). The CPU has no event, so the order is checked through one that
    logs its calls and what the buffers held when they came."""
    runner = llm.engine.executor.runner
    calls = []

    class Logged:
        def record(self):
            calls.append(("record", int(runner.buffers.tokens[0])))

        def synchronize(self):
            calls.append(("wait", int(runner.buffers.tokens[0])))

    monkeypatch.setattr(runner, "_uploaded", Logged())
    for token in (7, 9):
        out = _step(runner, [(0, 5)])
        out.scheduled[0].request.prompt_token_ids[:] = [token] * 5
        runner.logits(out)  # a step that does not sample
    # wait (before the buffers change), record (after they are uploaded) on every step
    assert [c[0] for c in calls] == ["wait", "record", "wait", "record"]
    assert calls[1][1] == 7 and calls[3][1] == 9 and calls[2][1] == 7
