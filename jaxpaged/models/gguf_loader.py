"""llama.cpp GGUF files (llama, qwen2, qwen3, gemma3) -> LlamaConfig, the params pytree.

Read with the `gguf` package (never torch): quantised tensors are dequantised
by `gguf.quants.dequantize`, llama.cpp's Q/K row permutation (done by its
converter for the llama arch's RoPE layout) is undone, and Gemma's norm weights,
which its converter stored as 1 + w, are turned back into w, so the weights
match Hugging Face's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from jaxpaged.models import registry
from jaxpaged.models.gguf_file import GGUFFile
from jaxpaged.models.llama import LlamaConfig, Params, UnsupportedModelError
from jaxpaged.models.params import param_shapes
from jaxpaged.models.weights import WeightLoadError, assemble_params

SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
})

# llama.cpp hard-codes what Gemma 3 GGUF files do not store: every 6th layer is global, the
# others windowed with RoPE base 10k.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise WeightLoadError(f"{path}: GGUF file not found")
    try:
        reader = GGUFFile(str(path))
    except Exception as err:  # gguf raises ValueError/struct errors on bad magic or truncation
        raise WeightLoadError(f"{path}: not a readable GGUF file ({err})") from None
    try:
        registry.family_for_gguf(metadata_value(reader, "general.architecture"))
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{path}: {err}") from None
    return reader


def metadata_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value as plain Python."""
    return reader.metadata.get(key, default)


def gguf_config(reader: GGUFFile) -> LlamaConfig:
    """LlamaConfig from the `{arch}.*` metadata (and the tensors present)."""
    arch = metadata_value(reader, "general.architecture")
    fam = registry.family_for_gguf(arch)

    def meta(key, default=None):
        value = metadata_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise WeightLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    scaling = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None, "linear"):
        raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported")
    names = {t.name: t for t in reader.tensors}
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    layers = int(meta("block_count"))
    eos = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    freq_factors = names.get("rope_freqs.weight")
    return LlamaConfig(
        vocab_size=int(metadata_value(reader, f"{arch}.vocab_size") or names["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_linear_factor=float(meta("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        rope_freq_factors=None if freq_factors is None else tuple(_tensor(freq_factors).tolist()),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=fam.name,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=metadata_value(reader, f"{arch}.attention.sliding_window"),
        **(_gemma3_fields(layers, meta) if fam.name == "gemma3" else {}),
    )


def _gemma3_fields(layers: int, meta) -> dict:
    windowed = tuple((i + 1) % _GEMMA3_SWA_PATTERN != 0 for i in range(layers))
    return dict(norm_weight_offset=1.0, scale_embeddings=True, hidden_act="gelu_tanh", sandwich_norms=True,
                query_pre_attn_scalar=float(meta("attention.key_length")), layer_windowed=windowed,
                local_rope_theta=_GEMMA3_LOCAL_ROPE_THETA)


def _tensor(tensor) -> np.ndarray:
    """Dequantise one GGUF tensor to float32 in numpy (row-major [out, in]) order."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} has type {qtype.name}; supported: "
                                    f"{sorted(t.name for t in SUPPORTED_TYPES)}")
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    return dequantize(tensor.data, qtype).astype(np.float32, copy=False).reshape(shape)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_params(reader: GGUFFile, config: LlamaConfig, dtype: np.dtype) -> Params:
    """The params pytree, dequantised and cast to `dtype`, on device."""
    names = {t.name: t for t in reader.tensors}
    fam = registry.family(config.architecture)
    e, h, k, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    unpermute = _unpermute if fam.gguf_unpermute_qk else lambda w, n: w
    # Gemma's converter stored norms as 1 + w; ours hold w (the config's norm_weight_offset adds 1).
    offset = config.norm_weight_offset if fam.gguf_norm_offset_baked else 0.0
    norm = (lambda w: w - offset) if offset else (lambda w: w)
    layouts = {
        "wq": lambda w: unpermute(w, h).T.reshape(e, h, d),
        "wk": lambda w: unpermute(w, k).T.reshape(e, k, d),
        "wv": lambda w: w.T.reshape(e, k, d),
        "wo": lambda w: w.T.reshape(h, d, e),
        "w_gate": lambda w: w.T, "w_up": lambda w: w.T, "w_down": lambda w: w.T,
        "bq": lambda w: unpermute(w, h).reshape(h, d), "bk": lambda w: unpermute(w, k).reshape(k, d),
        "bv": lambda w: w.reshape(k, d),
    }

    def reader_for(name, layout):
        if name not in names:
            raise WeightLoadError(f"GGUF file lacks tensor {name!r}")
        return lambda: layout(_tensor(names[name]))

    groups = [("embed", [reader_for("token_embd.weight", lambda w: w)]),
              ("final_norm", [reader_for("output_norm.weight", norm)])]
    if not config.tie_word_embeddings:
        groups.append(("lm_head", [reader_for("output.weight", lambda w: w.T)]))
    groups += [(key, [reader_for(f"blk.{i}.{registry.GGUF_LAYER_NAMES[key]}", layouts.get(key, norm))
                      for i in range(config.num_hidden_layers)])
               for key in param_shapes(config)["layers"]]
    return assemble_params(config, groups, dtype, "Dequantising GGUF tensors")


def gguf_checkpoint_dtype(reader: GGUFFile) -> np.dtype:
    """dtype='auto' for GGUF: bf16/f16 files keep theirs; quantised and f32 files load as float32."""
    types = {GGMLQuantizationType(t.tensor_type) for t in reader.tensors if t.name.endswith("attn_q.weight")}
    if types == {GGMLQuantizationType.BF16}:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if types == {GGMLQuantizationType.F16}:
        return np.dtype(np.float16)
    return np.dtype(np.float32)
