"""Hugging Face directories: config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json)."""

from __future__ import annotations

import glob
import json
import os

import torch

from engine.config import ModelConfig
from engine.loaders import ModelLoadError, ModelSource, file_digest
from engine.tokenizer import TokenizerInfo

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def load_hf_dir(path: str) -> ModelSource:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: invalid JSON ({e})") from None
    config = hf_config(raw, cfg_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    weights = _read_safetensors(files)
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        raise ModelLoadError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
    return ModelSource(config, weights, _tokenizer(path, raw), file_digest(files), path)


def hf_config(raw: dict, where: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{where}: architectures {archs} not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
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
        rope_theta=raw.get("rope_theta", 10000.0),
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        qk_norm=arch == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _read_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    return {k: v.float() for k, v in weights.items()}


def _tokenizer(path: str, raw: dict) -> TokenizerInfo:
    from tokenizers import Tokenizer

    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ModelLoadError(f"{path}: no tokenizer.json")
    tok = Tokenizer.from_file(tj)
    tc: dict = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)
    name = lambda v: v.get("content") if isinstance(v, dict) else v
    template = tc.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
    return TokenizerInfo(tok, template, name(tc.get("bos_token")), name(tc.get("eos_token")),
                         bool(tc.get("add_bos_token", False)))
