"""Model families: which checkpoints we load, and how each differs from Llama.

A family is data: the Hugging Face `architectures` / GGUF `general.architecture`
names that select it, a small function turning its config.json into the
`LlamaConfig` family fields, and the names of its extra tensors. The math is the
one decoder layer in `jaxpaged/models/llama.py`.

    family    HF architectures         GGUF arch   differences from Llama
    llama     LlamaForCausalLM         llama       -
    mistral   MistralForCausalLM       (llama)     optional sliding window on every layer
    qwen2     Qwen2ForCausalLM         qwen2       q/k/v biases
    qwen3     Qwen3ForCausalLM         qwen3       RMSNorm on q and k per head, explicit head_dim
    gemma3    Gemma3ForCausalLM        gemma3      (1 + w) norms, sqrt(E) embeddings, GeGLU, q/k norm,
                                                   sandwich norms, query_pre_attn_scalar, local
                                                   (windowed, own RoPE base) and global layers
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxpaged.models.llama import Llama3RopeScaling, LlamaConfig, UnsupportedModelError

# Our stacked layer param -> HF tensor name suffix (after "model.layers.{i}.") and GGUF name
# suffix (after "blk.{i}."); the weight/bias of the projections.
_BASE_HF = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
_GEMMA_HF = dict(_BASE_HF, mlp_norm="pre_feedforward_layernorm.weight",
                 post_attn_norm="post_attention_layernorm.weight",
                 post_mlp_norm="post_feedforward_layernorm.weight")
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight", "w_down": "ffn_down.weight", "bq": "attn_q.bias", "bk": "attn_k.bias",
    "bv": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]]  # config.json -> family LlamaConfig fields
    hf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=lambda: _BASE_HF)
    gguf_architecture: str | None = None
    gguf_unpermute_qk: bool = False  # llama.cpp permutes Q/K rows of the llama arch only
    gguf_norm_offset_baked: bool = False  # llama.cpp's converter stored Gemma's 1 + w as the weight


def _llama_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(hf, attention_bias=bool, mlp_bias=bool, sliding_window=lambda v: v is not None)
    return {}


def _mistral_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(hf, attention_bias=bool, mlp_bias=bool)
    return {"sliding_window": hf.get("sliding_window") or None, **_layer_windows(hf)}


def _qwen2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_windows(hf)}


def _qwen3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(hf.get("attention_bias", False)), "qk_norm": True, **_qwen_windows(hf)}


def _qwen_windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen configs carry a sliding_window that applies only when use_sliding_window is set."""
    if not hf.get("use_sliding_window", False):
        return {}
    return {"sliding_window": hf.get("sliding_window"), **_layer_windows(hf)}


def _gemma3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(hf, final_logit_softcapping=lambda v: v is not None, attn_logit_softcapping=lambda v: v is not None,
            use_bidirectional_attention=bool, attention_bias=bool)
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"config.rope_parameters.sliding_attention={local!r}: only default RoPE")
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return {"qk_norm": True, "norm_weight_offset": 1.0, "scale_embeddings": True, "sandwich_norms": True,
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "sliding_window": hf.get("sliding_window"), "local_rope_theta": float(local_theta),
            **_layer_windows(dict(hf, layer_types=layer_types))}


def _layer_windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """layer_types ("sliding_attention" / "full_attention") -> layer_windowed."""
    layer_types = hf.get("layer_types")
    if layer_types is None or not hf.get("sliding_window"):
        return {}
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"config.layer_types has unsupported kinds {sorted(unknown)}")
    return {"layer_windowed": tuple(t == "sliding_attention" for t in layer_types)}


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), _llama_fields, gguf_architecture="llama",
           gguf_unpermute_qk=True),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), _mistral_fields),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen2_fields, gguf_architecture="qwen2"),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen3_fields, gguf_architecture="qwen3"),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), _gemma3_fields, _GEMMA_HF,
           gguf_architecture="gemma3", gguf_norm_offset_baked=True),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    return _BY_NAME[name]


def supported_architectures() -> str:
    return ", ".join(a for f in FAMILIES for a in f.hf_architectures)


def family_for_hf(hf: Mapping[str, Any]) -> Family:
    """The family config.json's `architectures` (else `model_type`) names; a clear error otherwise."""
    architectures = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    for fam in FAMILIES:
        if architectures and all(a in fam.hf_architectures for a in architectures):
            return fam
        if not architectures and model_type in fam.hf_model_types:
            return fam
    raise UnsupportedModelError(
        f"config architectures={architectures!r}, model_type={model_type!r} is not supported; jaxpaged "
        f"supports {supported_architectures()}")


def family_for_gguf(arch: str | None) -> Family:
    for fam in FAMILIES:
        if fam.gguf_architecture is not None and fam.gguf_architecture == arch:
            return fam
    supported = ", ".join(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
    raise UnsupportedModelError(f"GGUF general.architecture={arch!r} is not supported; jaxpaged loads "
                                f"{supported}")


def config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """LlamaConfig from a Hugging Face config.json dict of any registered family."""
    fam = family_for_hf(hf)
    _refuse(hf, pretraining_tp=lambda v: v not in (None, 1))
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        raise UnsupportedModelError(f"config.hidden_act={act!r} is not supported (supported: {sorted(acts)})")
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    theta, scaling, linear = _rope_from_hf(hf)
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, rope_linear_factor=linear,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", fam.name == "gemma3")),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, architecture=fam.name,
        hidden_act=acts[act],
    )
    return LlamaConfig(**{**fields, **fam.hf_fields(hf)})


def _refuse(hf: Mapping[str, Any], **refused: Callable[[Any], bool]) -> None:
    for field, is_refused in refused.items():
        if field in hf and is_refused(hf[field]):
            raise UnsupportedModelError(f"config.{field}={hf[field]!r} is not supported by jaxpaged's "
                                        f"{family_for_hf(hf).name}")


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None, float]:
    """(theta, llama3 scaling, linear factor) of the global layers."""
    # transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older configs
    # `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None, 1.0
    if rope_type == "linear":
        return theta, None, float(params["factor"])
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"config.rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    ), 1.0
