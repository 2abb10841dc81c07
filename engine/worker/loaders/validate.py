"""Check that loaded tensors are the ones the config asks for, before the model copies them in.

A missing or misshapen tensor otherwise surfaces as a KeyError or a shape RuntimeError deep in
load_weights; here it becomes one line naming the tensor and the file."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.loaders.source import ModelLoadError
from tierserve.engine.worker.loaders.lazy import LazyWeights


EXTRA_LAYER_NORMS = {"gemma3": ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
"""Per family, the layer norms beyond input_layernorm and post_attention_layernorm (Gemma 3's
norms around the MLP; its post_attention_layernorm norms the attention's output)."""


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the model reads."""
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.q_size, h), p + "self_attn.k_proj.weight": (c.kv_size, h),
            p + "self_attn.v_proj.weight": (c.kv_size, h), p + "self_attn.o_proj.weight": (h, c.q_size),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (c.q_size,),
                           p + "self_attn.k_proj.bias": (c.kv_size,),
                           p + "self_attn.v_proj.bias": (c.kv_size,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                           p + "self_attn.k_norm.weight": (c.head_dim,)})
        shapes.update({f"{p}{n}.weight": (h,) for n in EXTRA_LAYER_NORMS.get(c.architecture, ())})
    return shapes


def check_weights(where: str, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """Names and shapes only: a LazyWeights answers both from the files' headers."""
    shapes = expected_shapes(config)
    shape_of = (weights.shape if isinstance(weights, LazyWeights)
                else lambda n: tuple(weights[n].shape))
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ModelLoadError(f"{where}: {len(missing)} tensor(s) missing for {config.architecture} "
                             f"with {config.num_layers} layers (first: {missing[0]})")
    for name, shape in shapes.items():
        if shape_of(name) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {shape_of(name)}, "
                                 f"the config implies {shape}")
