"""Block pool and prefix index: plain Python, no model."""

from __future__ import annotations

import subprocess
import sys

from tierserve.engine.core.block_hash import ROOT, extend_hashes, hash_block
from tierserve.engine.core.block_pool import BlockPool


def hashes(tokens, bs=4, extra=b"m"):
    out = []
    extend_hashes(out, tokens, bs, extra)
    return out


def test_no_torch_needed(tmp_path):
    """The scheduler, the block pool and the scheduler side of the KV connector (with the tier
    policy) import no torch, directly or through a package __init__."""
    code = ("import sys\n"
            "import tierserve, tierserve.engine.core.scheduler, tierserve.engine.core.block_pool\n"
            "import tierserve.engine.core.kv_connector, tierserve.engine.core.tier_policy\n"
            "from tierserve.engine.sampling_params import SamplingParams\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_chained_hash_depends_on_parent_and_extra():
    a = hash_block(ROOT, [1, 2, 3, 4], b"m")
    assert a == hash_block(ROOT, [1, 2, 3, 4], b"m")
    assert a != hash_block(ROOT, [1, 2, 3, 4], b"other-model")
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(ROOT, [5, 6, 7, 8])
    assert len(hashes(list(range(10)))) == 2  # only full blocks


def test_eviction_order_least_recently_freed_first_tail_before_prefix():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4] and pool.free_order() == [5]
    pool.free(a)  # a request frees last-to-first: its tail block is evicted before its prefix
    pool.free(b)
    assert pool.free_order() == [5, 2, 1, 0, 4, 3]
    assert pool.allocate(2) == [5, 2]


def test_prefix_hit_verifies_tokens_and_survives_until_evicted():
    pool = BlockPool(4, 4)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    hs = hashes(toks)
    blocks = pool.allocate(2)
    for i, bid in enumerate(blocks):
        pool.publish(bid, hs[i], toks[4 * i:4 * i + 4])
    pool.free(blocks)
    assert pool.match_prefix(hs, toks) == blocks  # free but still cached
    assert pool.match_prefix(hs, [1, 2, 3, 9] + toks[4:]) == []  # tokens differ: no hit
    pool.touch(blocks)
    assert pool.num_free == 2
    pool.free(blocks)
    pool.allocate(4)  # takes every block, evicting the cached ones
    assert pool.match_prefix(hs, toks) == []


def test_publish_keeps_first_writer_and_refcounts():
    pool = BlockPool(4, 2)
    h = hashes([1, 2], bs=2)
    x, y = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.publish(x, h[0], [1, 2])
    pool.publish(y, h[0], [1, 2])  # same content computed twice: the index keeps x
    assert pool.match_prefix(h, [1, 2]) == [x]
    pool.touch([x])
    pool.free([x])
    assert pool.blocks[x].ref_cnt == 1 and pool.num_free == 2
