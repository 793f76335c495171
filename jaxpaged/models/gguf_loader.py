"""llama.cpp GGUF files -> LlamaConfig, the params pytree, and a tokenizer.

Read with the `gguf` package (never torch): quantised tensors are dequantised
by `gguf.quants.dequantize`, and llama.cpp's Q/K row permutation (done by its
converter for its own RoPE layout) is undone so the weights match Hugging Face's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from jaxpaged.models.llama import LlamaConfig, Params, UnsupportedModelError
from jaxpaged.models.weights import WeightLoadError, assemble_params

SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
})

# Our stacked layer param -> GGUF tensor name.
_LAYER_TENSORS = {
    "attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight", "w_down": "blk.{i}.ffn_down.weight",
}


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise WeightLoadError(f"{path}: GGUF file not found")
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # gguf raises ValueError/struct errors on bad magic or truncation
        raise WeightLoadError(f"{path}: not a readable GGUF file ({err})") from None
    arch = metadata_value(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path}: general.architecture={arch!r}; jaxpaged loads only 'llama' GGUF files")
    return reader


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value as plain Python."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def gguf_config(reader: GGUFReader) -> LlamaConfig:
    """LlamaConfig from the `llama.*` metadata (and the tensors present)."""
    def meta(key, default=None):
        value = metadata_value(reader, f"llama.{key}", default)
        if value is None:
            raise WeightLoadError(f"GGUF metadata lacks llama.{key}")
        return value

    scaling = metadata_value(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise UnsupportedModelError(f"GGUF llama.rope.scaling.type={scaling!r} is not supported")
    names = {t.name: t for t in reader.tensors}
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    eos = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    freq_factors = names.get("rope_freqs.weight")
    return LlamaConfig(
        vocab_size=int(metadata_value(reader, "llama.vocab_size") or names["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_freq_factors=None if freq_factors is None else tuple(_tensor(freq_factors).tolist()),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


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


def load_gguf_params(reader: GGUFReader, config: LlamaConfig, dtype: np.dtype) -> Params:
    """The params pytree, dequantised and cast to `dtype`, on device."""
    names = {t.name: t for t in reader.tensors}
    e, h, k, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layouts = {
        "attn_norm": lambda w: w, "mlp_norm": lambda w: w,
        "wq": lambda w: _unpermute(w, h).T.reshape(e, h, d),
        "wk": lambda w: _unpermute(w, k).T.reshape(e, k, d),
        "wv": lambda w: w.T.reshape(e, k, d),
        "wo": lambda w: w.T.reshape(h, d, e),
        "w_gate": lambda w: w.T, "w_up": lambda w: w.T, "w_down": lambda w: w.T,
    }

    def reader_for(name, layout):
        if name not in names:
            raise WeightLoadError(f"GGUF file lacks tensor {name!r}")
        return lambda: layout(_tensor(names[name]))

    groups = [("embed", [reader_for("token_embd.weight", lambda w: w)]),
              ("final_norm", [reader_for("output_norm.weight", lambda w: w)])]
    if not config.tie_word_embeddings:
        groups.append(("lm_head", [reader_for("output.weight", lambda w: w.T)]))
    groups += [(key, [reader_for(template.format(i=i), layouts[key]) for i in range(config.num_hidden_layers)])
               for key, template in _LAYER_TENSORS.items()]
    return assemble_params(config, groups, dtype, "Dequantising GGUF tensors")


def gguf_checkpoint_dtype(reader: GGUFReader) -> np.dtype:
    """dtype='auto' for GGUF: bf16/f16 files keep theirs; quantised and f32 files load as float32."""
    types = {GGMLQuantizationType(t.tensor_type) for t in reader.tensors if t.name.endswith("attn_q.weight")}
    if types == {GGMLQuantizationType.BF16}:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if types == {GGMLQuantizationType.F16}:
        return np.dtype(np.float16)
    return np.dtype(np.float32)
