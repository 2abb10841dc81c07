"""Tensor parallel on the CPU (gloo): worker processes with a shard each give the greedy tokens of
one process, keep the prefix cache and the disk tier working, and a lost rank ends the server
cleanly (engine/worker/tp/, docs/parallel.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
import torch
import transformers

from tierserve.engine import LLM
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.worker.loaders import load_model_source

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL = dict(kv_cache_memory_bytes=64 << 20, quantization="none", max_num_seqs=8,
             max_num_batched_tokens=256)


def _random_llama(d, kv_heads: int) -> str:
    """A random Llama (4 query heads, MLP 128) with the embedded model's tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, max_position_embeddings=512,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5 if "embed" in name else 1.2 / p.shape[1] ** 0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(d, safe_serialization=True)
    tok = load_model_source("smollm2-135m").tokenizer
    tok.tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.eos_token,
                                                          "bos_token": tok.bos_token}))
    return str(d)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """2 KV heads: TP=2 splits them."""
    return _random_llama(tmp_path_factory.mktemp("tiny-llama"), kv_heads=2)


def test_kv_heads_replicate_when_ranks_outnumber_them(tmp_path, varied_prompts):
    """1 KV head, 2 ranks: each rank keeps the KV head its 2 query heads read."""
    model = _random_llama(tmp_path, kv_heads=1)
    prompts = [p[:100] for p in varied_prompts[2:6]]
    want = _tokens(LLM(model, **SMALL), prompts)
    two = LLM(model, tensor_parallel_size=2, **SMALL)
    try:
        assert _tokens(two, prompts) == want
    finally:
        two.engine.close()


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_tp2_equals_tp1_on_a_random_llama(tiny_llama, varied_prompts):
    prompts = [p[:200] for p in varied_prompts[:8]]
    one = LLM(tiny_llama, **SMALL)
    want = _tokens(one, prompts)
    assert len({t for s in want for t in s}) >= 12  # a model that says something
    two = LLM(tiny_llama, tensor_parallel_size=2, **SMALL)
    try:
        assert _tokens(two, prompts) == want
        assert two.engine.info.tensor_parallel_size == 2
        # what a GPU start does once every rank has profiled its memory: the ranks' caches made
        # again for the agreed block count (the prefix cache forgets the old ones)
        ex, before = two.engine.executor, two.engine.executor.facts().kv_bytes
        ex.allocate_kv(two.engine.pool.num_blocks, two.engine.max_model_len)
        two.engine.pool.reset_prefix_cache()
        assert ex.facts().kv_bytes == before and _tokens(two, prompts) == want
    finally:
        two.engine.close()


@pytest.fixture(scope="module")
def three() -> LLM:
    """The embedded model at TP=3, its shards quantized (gguf-exact: each rank keeps its slice of
    the GGUF's own blocks, the fp32 path's bits); shared by the tests that compare it with
    TP=1."""
    llm = LLM(tensor_parallel_size=3, **{**SMALL, "quantization": "gguf-exact",
                                        "kv_cache_memory_bytes": 256 << 20})
    yield llm
    llm.engine.close()


def test_tp3_embedded_model_equals_tp1(llm, three, varied_prompts):
    """Greedy tokens of TP=3 (quantized shards) equal TP=1's fp32 path on a quarter of the
    parity prompts (17 to 1,500 tokens)."""
    prompts = varied_prompts[3::4]
    assert max(map(len, prompts)) == 1500
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert _tokens(three, prompts, params) == _tokens(llm, prompts, params)
    info = three.engine.info
    assert info.quantization == "gguf-exact" and info.weight_bytes < 130 << 20, info


def test_prefix_cache_and_disk_tier_round_trip_under_tp2(tiny_llama, corpus_ids, tmp_path):
    """Each rank writes and reads its own shard of a block, in a folder of its own (the key
    names rank and world size); what the server reports (events, counters) comes from them."""
    from tierserve.engine.kv_tiers.events import BlockStored
    from tierserve.engine.worker.tp.protocol import rank_fingerprint

    prompt = corpus_ids[:160]
    tiers = dict(kv_tiers="disk", disk_tier_dir=str(tmp_path / "kv"))
    first = LLM(tiny_llama, tensor_parallel_size=2, **tiers, **SMALL)
    try:
        (a,) = first.generate([prompt], GREEDY)
        (b,) = first.generate([prompt], GREEDY)  # the device prefix cache
        assert b.num_cached_tokens >= 144 and b.outputs[0].token_ids == a.outputs[0].token_ids
        manager = first.engine.kv_worker.manager
        assert manager.flush()  # every rank's disk writes are done
        stored = [h for e in manager.events.since(0).events if isinstance(e.event, BlockStored)
                  for h in e.event.block_hashes]
        assert len(stored) >= 9  # rank 0's events, relayed: the prompt's full blocks
        disk = manager.stats()["disk"]
        assert disk.stored_blocks == len(stored)
        fp = first.engine.fingerprint
    finally:
        first.engine.close()
    folders = sorted(p.name for p in (tmp_path / "kv").iterdir() if p.name != ".secret")  # the tier's key
    assert folders == sorted(rank_fingerprint(fp, r, 2).hex() for r in range(2))
    for name in folders:  # a shard: one KV head of two, so half a block's bytes (+ a header)
        files = list((tmp_path / "kv" / name).rglob("*.safetensors"))
        assert len(files) == len(stored)
        assert all(disk.bytes_stored / 2 / len(stored) <= f.stat().st_size
                   < disk.bytes_stored / len(stored) for f in files)
    second = LLM(tiny_llama, tensor_parallel_size=2, **tiers, **SMALL)  # a cold device cache
    try:
        (c,) = second.generate([prompt], GREEDY)
        assert c.num_cached_tokens >= 144 and c.outputs[0].token_ids == a.outputs[0].token_ids
    finally:
        second.engine.close()
    other = LLM(tiny_llama, **tiers, **SMALL)  # TP=1 never reads TP=2's blocks
    (d,) = other.generate([prompt], GREEDY)
    assert d.num_cached_tokens == 0 and d.outputs[0].token_ids == a.outputs[0].token_ids


def test_cpu_tier_per_rank_takes_back_what_the_device_evicted(tiny_llama, corpus_ids):
    """Blocks the device cache evicts go to each rank's own cpu tier (its shard, in its memory)
    and come back from there: a prompt pushed out by two others is served from the tier."""
    kw = {**SMALL, "kv_cache_memory_bytes": None, "num_blocks": 24}
    llm = LLM(tiny_llama, tensor_parallel_size=2, kv_tiers="cpu", **kw)
    try:
        a, b, c = (corpus_ids[i:i + 160] for i in (0, 400, 800))
        (first,) = llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a's blocks are evicted from the device by now
        (again,) = llm.generate([a], GREEDY)
        assert again.num_cached_tokens >= 144
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        cpu = llm.engine.kv_worker.manager.stats()["cpu"]
        assert cpu.loaded_blocks == cpu.hit_blocks >= 4  # the rest still on the device
        # the engine is idle now: a reader of the event log still gets every store rank 0 made
        from tierserve.engine.kv_tiers.events import BlockStored

        manager, deadline = llm.engine.kv_worker.manager, time.monotonic() + 10
        while True:
            stored = sum(len(e.event.block_hashes) for e in manager.events.since(0).events
                         if isinstance(e.event, BlockStored))
            if stored == manager.stats()["cpu"].stored_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stored == manager.stats()["cpu"].stored_blocks > 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=2), "its 9 query heads do not divide by 2"),
])
def test_what_tensor_parallel_refuses(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        LLM(**kwargs, **SMALL)
    assert "\n" not in str(e.value)


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "tierserve.engine.worker.tp.rank"],
                         capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if _parent(int(p)) == pid]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_server_streams_under_tp3_and_a_lost_rank_ends_it(tmp_path, llm):
    import openai

    from server_fixtures import run_server

    prompt = "The history of the printing press"
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    # gguf-exact: the answer is checked against TP=1's fp32 path token for token
    with run_server(tmp_path, "--tensor-parallel-size", "3", "--quantization", "gguf-exact") as srv:
        client = openai.OpenAI(base_url=srv.v1, api_key="x")
        body = dict(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
        assert client.completions.create(**body).choices[0].text == want
        assert "".join(c.choices[0].text for c in client.completions.create(**body, stream=True)) \
            == want
        shaped = client.chat.completions.create(
            model="smollm2-135m", max_tokens=8, temperature=0,
            response_format={"type": "json_object"}, messages=[{"role": "user", "content": "hi"}])
        assert shaped.choices[0].message.content.lstrip().startswith("{")  # the grammar's mask
        workers = _workers(srv.proc.pid)
        assert len(workers) == 3
        events, health = [], None
        long = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.v1 + "/completions", json=long, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(workers[1], signal.SIGKILL)  # mid-stream
        health = httpx.get(srv.base_url + "/health", timeout=5).status_code
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert len(events) < 1000
        assert health == 503
        assert srv.proc.wait(30) != 0
        assert "tensor-parallel rank 1" in srv.log()
    deadline = time.monotonic() + 10
    while any(_parent(p) != -1 for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_parent(p) == -1 for p in workers), "a worker outlived the server"


@pytest.mark.parametrize("args, words", [
    (["--tensor-parallel-size", "2"], "its 9 query heads do not divide by 2"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     "unknown method 'eagle'"),
])
def test_serve_refuses_in_one_line(args, words):
    import sys

    r = subprocess.run([sys.executable, "-m", "tierserve.server.cli", "serve", "--port", "0",
                        "--log-level", "warning", *args], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if words in ln]
    assert len(lines) == 1 and lines[0].startswith("tierserve serve: "), r.stderr


def test_a_draft_model_proposes_for_the_ranks(tiny_llama, varied_prompts):
    """The draft runs in the main process (unsharded); the ranks verify its proposals (the
    random Llama as its own draft, TP=2)."""
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}
    prompts = [p[:200] for p in varied_prompts[4:6]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _tokens(LLM(tiny_llama, **SMALL), prompts, params)
    two = LLM(tiny_llama, tensor_parallel_size=2, speculative_config=spec, **SMALL)
    try:
        assert _tokens(two, prompts, params) == want
        stats = two.engine.spec_stats()
        assert 0 < 0.9 * stats.num_draft_tokens <= stats.num_accepted_tokens
    finally:
        two.engine.close()


def test_structured_outputs_under_tp3_equal_tp1(llm, three):
    """The main process's matchers fill each constrained row's bitmask; every rank masks its
    logits with it: constrained and free rows in one batch give TP=1's tokens."""
    from tierserve.engine.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompts = ["Describe a person as JSON:", "Is the sky blue? Answer:", "The weather today"]
    params = [SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutput.json(schema)),
              SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutput.regex("(yes|no), [a-z ]{4,30}")),
              SamplingParams(temperature=0, max_tokens=12)]
    want = [o.outputs[0] for o in llm.generate(prompts, params)]
    got = [o.outputs[0] for o in three.generate(prompts, params)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert set(json.loads(got[0].text)) == {"name", "age"}
    assert got[1].text.startswith(("yes, ", "no, "))


def test_sparse_decode_per_rank_equals_tp1(tiny_llama, corpus_ids):
    """Each rank scores and picks the blocks of its own KV heads: the same picks as TP=1's (the
    random Llama, a KV head per rank at TP=2)."""
    kw = dict(SMALL, sparse_topk_blocks=4, sparse_min_context=128, sparse_dense_layers=0)
    prompts = [corpus_ids[:440], corpus_ids[1000:1300]]
    want = _tokens(LLM(tiny_llama, **kw), prompts)
    two = LLM(tiny_llama, tensor_parallel_size=2, **kw)
    try:
        assert _tokens(two, prompts) == want
        stats = two.engine.executor.sparse_stats()  # rank 0's heads
        assert 0 < stats.blocks_attended < stats.blocks_total
    finally:
        two.engine.close()


def test_prefill_bf16_runs_on_every_rank(llm):
    """--prefill-bf16 under TP=3: each rank's prefill linears and attention in bf16 on AMX keep
    issue 31's bound against the fp32 path (teacher-forced, real text); without AMX the start
    stops in one line."""
    from pathlib import Path

    from tierserve.engine.eval.quant import agreement, perplexity_change, score
    from tierserve.kernels.native import cpu_has

    if not cpu_has("amx_bf16"):
        with pytest.raises(ValueError, match="AMX") as e:
            LLM(tensor_parallel_size=3, prefill_bf16=True, **SMALL)
        assert "\n" not in str(e.value)
        return
    text = (Path(__file__).parent / "data" / "long_text.md").read_text()
    ids = llm.get_tokenizer().encode(text)[:1100]
    ref = score(llm, ids)
    three = LLM(tensor_parallel_size=3, prefill_bf16=True, **{**SMALL, "quantization": "auto"})
    try:
        test = score(three, ids)
    finally:
        three.engine.close()
    assert 0.98 <= agreement(test, ref) < 1.0  # bf16's rounding: close, not the same bits
    assert abs(perplexity_change(test, ref)) < 0.01


def test_a_rank_that_cannot_load_stops_the_start_with_its_error(llm):
    """The ranks load the model themselves: one that fails reports its error, the start fails
    with it, and no rank is left running."""
    import dataclasses

    from tierserve.engine.worker.tp.executor import TPExecutor, WorkerDied

    cfg = dataclasses.replace(llm.engine.config, model="/nonexistent/model.gguf")
    before = set(_workers(os.getpid()))
    with pytest.raises(WorkerDied, match="tensor-parallel rank .* failed") as e:
        TPExecutor(cfg, llm.engine.model_config, 16, 256, 3, 2)
    assert "/nonexistent/model.gguf" in str(e.value)
    time.sleep(0.5)
    assert set(_workers(os.getpid())) <= before
