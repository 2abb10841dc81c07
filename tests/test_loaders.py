"""Model loading: tiny random HF checkpoints and GGUFs written here give HF's greedy tokens; bad
inputs give one-line ModelLoadErrors. No downloads: the only real weights are the embedded GGUF."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tierserve.engine import LLM, SamplingParams
from tierserve.engine.worker.loaders import ModelLoadError, ModelSource, load_model_source
from tierserve.engine.worker.loaders.gguf_file import read_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

NEW_TOKENS = 20
PROMPTS = ["The quick brown fox", "def fib(n):\n    return", "Paris is the capital of",
           "1, 2, 3, 5, 8,"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, rms_norm_eps=1e-6)
ENGINE = dict(kv_cache_memory_bytes=4 << 20, max_num_seqs=8, max_num_batched_tokens=128,
              block_size=16, num_threads=1)


@pytest.fixture(scope="module")
def embedded() -> ModelSource:
    return load_model_source("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer_files(embedded, tmp_path_factory) -> Path:
    """tokenizer.json + tokenizer_config.json built from the embedded GGUF's tokenizer."""
    d = tmp_path_factory.mktemp("tok")
    info = embedded.tokenizer
    info.tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": info.chat_template, "eos_token": info.eos_token,
        "bos_token": info.bos_token, "add_bos_token": False}))
    return d


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy decoding does not settle on one token."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5 if "embed" in name else 1.2 / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:  # RMSNorm weights (also Qwen3's q/k norms)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))


def _hf_model(config_cls, seed: int, **kw):
    config = config_cls(vocab_size=49152, **{**TINY, **kw})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def _save_hf(model, tokenizer_dir: Path, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def _hf_greedy(model, prompts_ids: list[list[int]]) -> list[list[int]]:
    outs = []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def _our_greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _assert_varied(seqs: list[list[int]]) -> None:
    """A random model that repeats one token would make the comparison meaningless."""
    assert all(len(set(s)) >= 2 for s in seqs), seqs
    assert len({t for s in seqs for t in s}) >= 12, seqs


HF_CASES = {
    "llama-untied-llama3-rope": (transformers.LlamaConfig, dict(
        tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama-linear-rope": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True, rope_scaling=dict(rope_type="linear", factor=4.0))),
    # yarn: ramped frequencies and cos/sin scaled by 1 + 0.1 ln 4
    "qwen2-yarn-rope": (transformers.Qwen2Config, dict(
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))),
    "mistral-tied": (transformers.MistralConfig, dict(tie_word_embeddings=True)),
    "qwen2-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_dir_greedy_matches_transformers(case, tokenizer_files, tmp_path, monkeypatch):
    config_cls, kw = HF_CASES[case]
    model = _hf_model(config_cls, seed=len(case), **kw)
    path = _save_hf(model, tokenizer_files, tmp_path / case)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    prompt_ids = [hf_tok(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    expected = _hf_greedy(model, prompt_ids)
    _assert_varied(expected)

    llm = LLM(model=str(path), **ENGINE)
    assert [llm.get_tokenizer().encode(p) for p in PROMPTS] == prompt_ids
    assert _our_greedy(llm, PROMPTS) == expected  # strings, one batch
    assert _our_greedy(llm, prompt_ids[1]) == expected[1:2]  # token ids, alone
    # decode steps of any size in one native call (csrc/decode_forward.cpp; not for q/k norms)
    model = llm.engine.executor.runner.model
    monkeypatch.setattr(model, "stack_decode_min_batch", 1)
    assert _our_greedy(llm, PROMPTS) == expected


def test_hf_dir_config_fields(tokenizer_files, tmp_path):
    config_cls, kw = HF_CASES["llama-untied-llama3-rope"]
    path = _save_hf(_hf_model(config_cls, 0, **kw), tokenizer_files, tmp_path / "m")
    cfg = load_model_source(str(path)).config
    assert (cfg.architecture, cfg.rope_theta, cfg.tie_word_embeddings) == ("llama", 50000.0, False)
    assert cfg.rope_scaling["rope_type"] == "llama3"


def test_hf_dir_chat_template_matches_transformers(tokenizer_files, tmp_path):
    path = _save_hf(_hf_model(transformers.Qwen3Config, 0, tie_word_embeddings=True),
                    tokenizer_files, tmp_path / "m")
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    ours = LLM(model=str(path), **ENGINE).get_tokenizer()
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(chat) == hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


# --- GGUF written here: llama.cpp's q/k row permutation must be undone ---------------------------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}"
    return f"{_GGUF_TOP[base]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reordering of q/k rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _copy_tokenizer_metadata(writer, embedded_path: str) -> None:
    fields = read_gguf(embedded_path).fields
    c = fields.__getitem__
    writer.add_tokenizer_model(c("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(c("tokenizer.ggml.pre"))
    writer.add_token_list(c("tokenizer.ggml.tokens"))
    writer.add_token_types(c("tokenizer.ggml.token_type"))
    writer.add_token_merges(c("tokenizer.ggml.merges"))
    writer.add_bos_token_id(c("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(c("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(c("tokenizer.chat_template"))


def _write_llama_gguf(model, path: Path, embedded_path: str, q8: set[str] = frozenset(),
                      q8_1: str | None = None) -> None:
    """Writes model as arch 'llama'. Tensors whose HF name contains a string in q8 become Q8_0,
    and the model's own copy becomes their Q8_0 round trip, so HF sees what the GGUF holds.
    The tensor named q8_1 is written as zeros of type Q8_1, which gguf cannot dequantize."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    kind = cfg.rope_parameters.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    _copy_tokenizer_metadata(w, embedded_path)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(
            name.split(".")[-2])
        arr = t.detach().float().numpy()
        arr = _permute(arr, heads) if heads else arr
        if name == q8_1:
            qt = gguf.GGMLQuantizationType.Q8_1  # 32 values in 40 bytes
            w.add_tensor(_gguf_name(name), np.zeros((arr.shape[0], arr.shape[1] // 32 * 40),
                                                    np.uint8), raw_dtype=qt)
        elif any(s in name for s in q8):
            qt = gguf.GGMLQuantizationType.Q8_0
            packed = gguf.quants.quantize(arr, qt)
            w.add_tensor(_gguf_name(name), packed, raw_dtype=qt)
            # Q8_0 quantizes along rows, so it commutes with the row permutation.
            deq = gguf.quants.dequantize(packed, qt).reshape(arr.shape)
            t.copy_(torch.from_numpy(_unpermute(deq, heads) if heads else deq))
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_gguf_llama_unpermuted_matches_transformers(embedded, tmp_path):
    model = _hf_model(transformers.LlamaConfig, seed=7, tie_word_embeddings=False)
    path = tmp_path / "tiny-llama.gguf"
    _write_llama_gguf(model, path, embedded.path, q8={"mlp.", "layers.1.self_attn.q_proj",
                                                      "layers.0.self_attn.k_proj", "lm_head"})
    llm = LLM(model=str(path), **ENGINE)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    expected = _hf_greedy(model, prompt_ids)
    _assert_varied(expected)
    assert _our_greedy(llm, PROMPTS) == expected


@pytest.mark.parametrize("rope", [dict(rope_type="linear", factor=4.0),
                                  dict(rope_type="yarn", factor=4.0,
                                       original_max_position_embeddings=16)],
                         ids=lambda r: r["rope_type"])
def test_gguf_rope_scaling_matches_transformers(embedded, tmp_path, rope):
    """llama.cpp's rope.scaling.* keys are read: the output follows the scaled model's."""
    model = _hf_model(transformers.LlamaConfig, seed=11, tie_word_embeddings=False,
                      rope_scaling=rope)
    path = tmp_path / "tiny-scaled.gguf"
    _write_llama_gguf(model, path, embedded.path)
    assert load_model_source(str(path)).config.rope_scaling["rope_type"] == rope["rope_type"]
    llm = LLM(model=str(path), **ENGINE)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    expected = _hf_greedy(model, prompt_ids)
    _assert_varied(expected)
    assert _our_greedy(llm, PROMPTS) == expected
    unscaled = _hf_model(transformers.LlamaConfig, seed=11, tie_word_embeddings=False)
    assert _hf_greedy(unscaled, prompt_ids) != expected  # the scaling changes the output


def test_gguf_q_k_rows_come_back_in_hf_order(embedded, tmp_path):
    """The permutation is not the identity for these shapes, so the test above exercises it."""
    src_model = _hf_model(transformers.LlamaConfig, seed=7, tie_word_embeddings=False)
    path = tmp_path / "tiny-llama.gguf"
    _write_llama_gguf(src_model, path, embedded.path, q8=set())
    src = load_model_source(str(path))
    ref = src_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(_permute(ref.numpy(), 4), ref.numpy())
    assert torch.equal(src.weights["model.layers.0.self_attn.q_proj.weight"], ref)
    assert torch.equal(src.weights["model.layers.0.self_attn.v_proj.weight"],
                       src_model.state_dict()["model.layers.0.self_attn.v_proj.weight"])


# --- the embedded model --------------------------------------------------------------------------

def test_embedded_smollm2_shape(embedded):
    c = embedded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 30, 9, 3, 64)
    assert c.tie_word_embeddings and "lm_head.weight" not in embedded.weights
    assert c.vocab_size == 49152 and embedded.tokenizer.chat_template


# --- errors: one line that names the problem -----------------------------------------------------

def _load_error(name: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model_source(name)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_wrong_path():
    assert "not found" in _load_error("/nonexistent/model.gguf")


def test_llm_with_unknown_model_raises_model_load_error():
    with pytest.raises(ModelLoadError, match="nope"):
        LLM(model="nope")


@pytest.mark.parametrize("keep", [0, 1 << 20, 40 << 20])
def test_truncated_gguf(embedded, tmp_path, keep):
    """Empty, cut inside the metadata (1 MiB) and inside the tensor data (40 MiB)."""
    path = tmp_path / "cut.gguf"
    with open(embedded.path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(keep))
    assert "truncated" in _load_error(str(path))


def _tiny_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture(tmp_path):
    path = _tiny_gguf(tmp_path / "f.gguf", "falcon",
                      {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    msg = _load_error(str(path))
    assert "'falcon'" in msg and "llama" in msg


def test_gguf_without_model_metadata(tmp_path):
    path = _tiny_gguf(tmp_path / "bare.gguf", "llama",
                      {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    assert "llama.embedding_length" in _load_error(str(path))


def test_gguf_tensor_type_gguf_cannot_dequantize(embedded, tmp_path):
    """Refused at load, also where tensors are read only when the model copies them in (the
    daemon's way: the suite's cache decodes every tensor at load)."""
    from tierserve.engine.worker.loaders.gguf_loader import load_gguf

    model = _hf_model(transformers.LlamaConfig, seed=1, tie_word_embeddings=False)
    path = tmp_path / "q81.gguf"
    _write_llama_gguf(model, path, embedded.path, q8_1="model.layers.0.mlp.down_proj.weight")
    msg = _load_error(str(path))
    assert "Q8_1" in msg and "blk.0.ffn_down.weight" in msg
    with pytest.raises(ModelLoadError, match="Q8_1"):
        load_gguf(str(path), lazy=True)


def test_gguf_read_when_asked_gives_the_same_tensors(embedded):
    """The daemon's GGUF weights decode each tensor when it is read (nothing kept: two reads are
    two tensors), the same names, shapes and values as the load that decodes all at once."""
    from tierserve.engine.worker.loaders.gguf_loader import load_gguf
    from tierserve.engine.worker.loaders.lazy import LazyWeights

    lazy = load_gguf(embedded.path, lazy=True)
    assert isinstance(lazy.weights, LazyWeights) and set(lazy.weights) == set(embedded.weights)
    assert lazy.config == embedded.config and set(lazy.blocks) == set(embedded.blocks)
    for name in list(embedded.weights)[::7]:
        got = lazy.weights[name]
        assert lazy.weights.shape(name) == tuple(got.shape)
        assert torch.equal(got, embedded.weights[name]), name
    name = "model.layers.0.self_attn.q_proj.weight"
    assert lazy.weights[name].data_ptr() != lazy.weights[name].data_ptr()


@pytest.fixture()
def hf_dir(tokenizer_files, tmp_path) -> Path:
    model = _hf_model(transformers.LlamaConfig, seed=3, tie_word_embeddings=True)
    return _save_hf(model, tokenizer_files, tmp_path / "hf")


def test_hf_unsupported_architecture(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(str(hf_dir))
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg


def test_hf_unsupported_rope_scaling(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(str(hf_dir))
    assert "'dynamic'" in msg and "yarn" in msg


def test_hf_missing_safetensors(hf_dir):
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    assert "safetensors" in _load_error(str(hf_dir))


def test_hf_missing_config(hf_dir):
    (hf_dir / "config.json").unlink()
    assert "config.json" in _load_error(str(hf_dir))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_hf_corrupt_safetensors(hf_dir, damage):
    f = next(hf_dir.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    msg = _load_error(str(hf_dir))
    assert "safetensors" in msg and f.name in msg


def test_hf_missing_tensor(hf_dir):
    from safetensors.torch import load_file, save_file

    f = next(hf_dir.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    assert "model.layers.1.mlp.up_proj.weight" in _load_error(str(hf_dir))


def test_hf_config_missing_field(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert "hidden_size" in _load_error(str(hf_dir))


def test_hf_config_shape_mismatch(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert "mlp" in _load_error(str(hf_dir))


def test_file_that_is_neither(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"x")
    assert ".gguf" in _load_error(str(p))


def test_hf_missing_tokenizer(hf_dir):
    (hf_dir / "tokenizer.json").unlink()
    assert "tokenizer.json" in _load_error(str(hf_dir))


@pytest.mark.parametrize("bos_by", ["post_processor", "tokenizer_config"])
def test_hf_dir_bos_like_transformers(hf_dir, bos_by):
    """Llama 3 dirs add BOS in tokenizer.json's post-processor; transformers 5 ignores
    tokenizer_config's add_bos_token when there is a tokenizer.json, and so do we."""
    from tokenizers import Tokenizer, processors

    from tierserve.engine.tokenizer import TextTokenizer

    if bos_by == "post_processor":
        tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
        tok.save(str(hf_dir / "tokenizer.json"))
    else:
        tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({**tc, "add_bos_token": True}))
    ours = TextTokenizer(load_model_source(str(hf_dir)).tokenizer)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    for text in PROMPTS:
        assert ours.encode(text) == hf_tok(text)["input_ids"]
        assert (ours.encode(text)[0] == 1) == (bos_by == "post_processor")


def test_kept_gguf_source_is_reused_only_while_the_file_is_unchanged(embedded, tmp_path):
    """With KEEP_LAST_GGUF (on in the test suite) a second load of the same file shares the
    tensors, each load with a dict of its own; a file changed since (its mtime) is loaded afresh."""
    from tierserve.engine.worker import loaders
    assert loaders.KEEP_LAST_GGUF
    path = tmp_path / "tiny.gguf"
    _write_llama_gguf(_hf_model(transformers.LlamaConfig, seed=1), path, embedded.path)
    a, b = load_model_source(str(path)), load_model_source(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    assert a.weights is not b.weights and a.weights[name] is b.weights[name]
    a.weights.pop(name)
    assert name in load_model_source(str(path)).weights
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # rewritten, as tools do
    c = load_model_source(str(path))
    assert c.weights[name] is not b.weights[name] and torch.equal(c.weights[name], b.weights[name])


def test_quantized_linears_with_a_qkv_bias_in_one_call_and_layer_by_layer(tokenizer_files,
                                                                           tmp_path, monkeypatch):
    """int8 weights on a model whose qkv projection has a bias (Qwen2): the decode stack takes
    the bias whole panels long as for fp32, and gives the layer-by-layer path's tokens."""
    config_cls, kw = HF_CASES["qwen2-bias"]
    path = _save_hf(_hf_model(config_cls, seed=3, **kw), tokenizer_files, tmp_path / "m")
    llm = LLM(model=str(path), quantization="int8", **ENGINE)
    model = llm.engine.executor.runner.model
    assert model._qstack and model._stack[2].numel() % 16 == 0  # the qkv bias, padded
    monkeypatch.setattr(model, "stack_decode_min_batch", 0)
    by_layer = _our_greedy(llm, PROMPTS)
    monkeypatch.setattr(model, "stack_decode_min_batch", 1)
    assert _our_greedy(llm, PROMPTS) == by_layer


def test_one_pass_header_reads_what_the_gguf_package_reads(gguf_path, tmp_path):
    """read_gguf (a single struct pass over the header) gives the gguf package's GGUFReader's
    metadata values and tensor table, and the same bytes for every tensor; a file that is not
    GGUF, or of another version, is refused."""
    r, mine = gguf.GGUFReader(gguf_path), read_gguf(gguf_path)
    want = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert mine.fields == want
    assert [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes)
            for t in r.tensors] == \
        [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in mine.tensors]
    for a, b in zip(r.tensors, mine.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf(str(bad))
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(64))
    with pytest.raises(ValueError, match="version 7"):
        read_gguf(str(bad))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_decoder_gives_the_gguf_packages_values(kind):
    """gguf_blocks.dequantize (torch over a whole tensor) gives gguf.quants.dequantize's fp32
    bits on random blocks, scales at fp16's edges included (subnormal, the largest, zero,
    negative, infinity, NaNs of both signs: numpy keeps their sign, torch's Half -> float did not
    past its last whole vector); a row that is not whole blocks is refused."""
    from tierserve.engine.worker.loaders.gguf_blocks import BLOCK_BYTES, dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(7)
    rows, cols = 25, 96  # 75 blocks: NaNs also past the last whole vector of scales
    raw = rng.integers(0, 256, size=(rows, cols // 32 * BLOCK_BYTES[kind]), dtype=np.uint8)
    edges = np.array([6e-8, 65504.0, 0.0, -1.5, -0.0, np.inf, 1e-3, 2.0, np.nan, -np.nan, 0.5],
                     np.float16)
    blocks = raw.reshape(rows, cols // 32, BLOCK_BYTES[kind])
    blocks[:, :, 0:2] = np.resize(edges, blocks.shape[:2]).reshape(*blocks.shape[:2], 1).view(
        np.uint8)
    with np.errstate(invalid="ignore"):  # NaN and inf scales times zero codes
        want = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw, kind, (rows, cols))
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="not whole blocks"):
        dequantize(raw, kind, (rows * 2, cols // 2))


def test_block_decoder_on_the_embedded_file(gguf_path):
    """Every tenth quantized tensor of the embedded GGUF, and its Q8_0 embedding, decode to the
    gguf package's bits."""
    from tierserve.engine.worker.loaders.gguf_blocks import HEAD_BYTES, dequantize

    f = read_gguf(gguf_path)
    quantized = [t for t in f.tensors if t.tensor_type.name in HEAD_BYTES]
    assert len(quantized) == 211  # 210 Q4_1 linears, the Q8_0 embedding
    for t in quantized[::10] + quantized[-1:]:
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = dequantize(t.data, t.tensor_type.name, want.shape)
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), t.name
