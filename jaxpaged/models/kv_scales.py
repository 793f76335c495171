"""A checkpoint's fp8 KV cache scales: read from a Hugging Face safetensors folder and checked.

FP8 checkpoints made with llm-compressor (compressed-tensors) store, per attention layer, the scales their
KV cache was calibrated with: `model.layers.{i}.self_attn.k_scale` and `.v_scale`. NVIDIA ModelOpt
names them `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`, and older checkpoints one
`self_attn.kv_scale` for both. Each holds one value (per tensor: shape [] or [1]) or one per KV head
([num_key_value_heads]); a stored e4m3 element e stands for e * scale (the convention of
pallas_kernels/kv_quant.py). Nothing else of the checkpoint is read here.

`read_kv_scales` returns (k_scale, v_scale) float32 [L, K] or None when the checkpoint has none; a scale that
is zero, negative or not finite, mis-shaped, or present for some layers and not others raises
KVScaleError, so an engine never starts with a cache it would read wrong.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np

from jaxpaged.models.llama import LlamaConfig
from jaxpaged.models.weights import WeightLoadError, safetensors_files

# Each kind of scale's tensor names inside a layer, the first one present is read. kv_scale (one tensor for
# both) is the deprecated form: K and V then share it.
_NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.kv_scale"),
          "v": ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.kv_scale")}
_LAYER = "model.layers.{i}."


class KVScaleError(WeightLoadError):
    """A checkpoint's KV cache scales are missing for some layers, mis-shaped, or not positive and finite."""


def read_kv_scales(source: Path, config: LlamaConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """(k_scale, v_scale) f32 [L, K] from the checkpoint folder `source`, or None if it stores no KV scales
    (or is no safetensors folder: a GGUF file, a jaxpaged checkpoint)."""
    source = Path(source)
    if not source.is_dir() or not (source / "config.json").is_file():
        return None
    try:
        files = safetensors_files(source)
    except WeightLoadError:
        return None
    layers = config.num_hidden_layers
    found = {kind: [_first_present(files, i, names) for i in range(layers)] for kind, names in _NAMES.items()}
    present = [name for names in found.values() for name in names if name is not None]
    if not present:
        return None
    missing = [f"{kind} of layer {i}" for kind, names in found.items() for i, n in enumerate(names) if n is None]
    if missing:
        raise KVScaleError(f"{source}: the checkpoint stores KV cache scales for some layers but not "
                           f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="numpy"))
                   for path in sorted({files[name] for name in present})}
        out = [np.stack([_checked(handles[files[name]].get_tensor(name), name, config.num_key_value_heads, source)
                         for name in found[kind]]) for kind in ("k", "v")]
    return out[0], out[1]


def _first_present(files: dict, layer: int, names: tuple[str, ...]) -> str | None:
    prefix = _LAYER.format(i=layer)
    return next((prefix + n for n in names if prefix + n in files), None)


def _checked(value: np.ndarray, name: str, num_kv_heads: int, source: Path) -> np.ndarray:
    """One layer's scale as f32 [K] (a per-tensor value repeated); KVScaleError if mis-shaped or not > 0."""
    value = np.asarray(value, np.float32)
    if value.size == 1 and value.ndim <= 1:
        value = np.full((num_kv_heads,), value.reshape(()), np.float32)
    elif value.shape != (num_kv_heads,):
        raise KVScaleError(f"{source}: {name} has shape {list(value.shape)}; a KV cache scale is one value "
                           f"(per tensor) or one per KV head ([{num_kv_heads}])")
    if not np.all(np.isfinite(value)) or np.any(value <= 0):
        raise KVScaleError(f"{source}: {name} = {value.tolist()}: KV cache scales must be finite and > 0")
    return value
