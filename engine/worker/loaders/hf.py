"""Hugging Face directories: config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json)."""

from __future__ import annotations

import glob
import json
import os

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.loaders.source import ModelLoadError, ModelSource, file_digest, one_line
from tierserve.engine.worker.loaders.lazy import LazyWeights, safetensors_entries
from tierserve.engine.worker.loaders.validate import check_weights
from tierserve.engine.worker.models.layers import ROPE_TYPES, rope_type
from tierserve.engine.tokenizer import TokenizerInfo

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
GEMMA3_SLIDING_PATTERN = 6
"""transformers' Gemma3TextConfig: without layer_types, layer i is windowed unless (i + 1) % 6 == 0
(sliding_window_pattern, 6 by default)."""


def load_hf_dir(path: str) -> ModelSource:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    raw = _read_json(cfg_path)
    config = hf_config(raw, cfg_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    weights = _read_safetensors(files)
    check_weights(path, config, weights)
    return ModelSource(config, weights, _tokenizer(path), file_digest(files), path)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable JSON ({one_line(e)})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def hf_config(raw: dict, where: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{where}: architectures {archs} not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if not isinstance(raw.get(k), int)]
    if missing:
        raise ModelLoadError(f"{where}: missing or non-integer {', '.join(missing)}")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    family = _gemma3(raw, where) if arch == "gemma3" else {}
    theta, scaling = family.pop("rope", None) or _rope(raw)
    if rope_type(scaling) not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope scaling type {rope_type(scaling)!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", arch == "gemma3"),
        # Qwen2 always has q/k/v biases and its config.json does not say so.
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **family,
    )


def _gemma3(raw: dict, where: str) -> dict:
    """Gemma 3's fields beyond the Llama family's (transformers' Gemma3TextConfig, 4.x's keys
    or 5's), with "rope": the whole-context layers' (theta, scaling). Soft-capping and
    bidirectional attention (Gemma 2, EmbeddingGemma) are refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{where}: {key} {raw[key]} is not supported (Gemma 3 has none)")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: use_bidirectional_attention is not supported (a causal "
                             f"decoder only)")
    n = raw["num_hidden_layers"]
    if raw.get("layer_types") is not None and len(raw["layer_types"]) != n:
        raise ModelLoadError(f"{where}: {len(raw['layer_types'])} layer_types for {n} layers")
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % raw.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN) == 0
        else "sliding_attention" for i in range(n)]
    params = raw.get("rope_parameters") or {}
    whole, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = float(whole.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    scaling = raw.get("rope_scaling") or (whole if whole.get("rope_type", "default") != "default"
                                          else None)
    return dict(
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_window=raw.get("sliding_window") or None,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rope_local_base_freq=float(local.get("rope_theta", raw.get("rope_local_base_freq",
                                                                   10_000.0))),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        rope=(theta, scaling))


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling). transformers 5 writes both into rope_parameters; 4.x wrote rope_theta and
    rope_scaling at the top level."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                          else None)
    return theta, scaling


def _read_safetensors(files: list[str]) -> LazyWeights:
    """The files' tensors, read one at a time as the model copies them in (loaders/lazy.py)."""
    entries = {}
    for f in files:
        try:
            entries.update(safetensors_entries(f))
        except Exception as e:  # SafetensorError, OSError, ValueError, a truncated header...
            raise ModelLoadError(f"{f}: unreadable safetensors file ({one_line(e)})") from None
    return LazyWeights(entries)


def _tokenizer(path: str) -> TokenizerInfo:
    from tokenizers import Tokenizer

    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ModelLoadError(f"{path}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(tj)
    except Exception as e:
        raise ModelLoadError(f"{tj}: unreadable tokenizer ({one_line(e)})") from None
    tc_path = os.path.join(path, "tokenizer_config.json")
    tc = _read_json(tc_path) if os.path.isfile(tc_path) else {}
    name = lambda v: v.get("content") if isinstance(v, dict) else v
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
    # BOS comes from tokenizer.json's post-processor, as in transformers 5, which ignores
    # tokenizer_config's add_bos_token for a tokenizer.json (Llama 3 dirs rely on this).
    return TokenizerInfo(tok, template, name(tc.get("bos_token")), name(tc.get("eos_token")),
                         add_bos=False)
