"""Hugging Face safetensors -> the params pytree (every family in jaxpaged/models/registry.py).

Reads tensor by tensor from memory-mapped files (single or sharded through
`model.safetensors.index.json`) and fills one stacked [L, ...] buffer at a
time, which is moved to the device before the next is read: host RAM never
holds two full copies of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxpaged.models import registry
from jaxpaged.models.fp8_checkpoint import Fp8ScaleError, read_fp8_weight
from jaxpaged.models.llama import LlamaConfig, Params
from jaxpaged.models.params import param_shapes
from jaxpaged.models.quant_config import CheckpointQuantization

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(RuntimeError):
    """A checkpoint's files are missing, truncated or do not match its config."""


def _hf_layer_tensors(config: LlamaConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    """Our stacked layer param -> (HF name template, transform of the [out, in] torch weight)."""
    e, h, k, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    names = registry.family(config.architecture).hf_layer_names
    layouts = {
        "wq": lambda w: w.T.reshape(e, h, d), "wk": lambda w: w.T.reshape(e, k, d),
        "wv": lambda w: w.T.reshape(e, k, d), "wo": lambda w: w.T.reshape(h, d, e),
        "w_gate": lambda w: w.T, "w_up": lambda w: w.T, "w_down": lambda w: w.T,
        "bq": lambda w: w.reshape(h, d), "bk": lambda w: w.reshape(k, d), "bv": lambda w: w.reshape(k, d),
    }
    return {key: ("model.layers.{i}." + names[key], layouts.get(key, lambda w: w))
            for key in param_shapes(config)["layers"]}


def _top_level_tensors(config: LlamaConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    tensors = {
        "embed": ("model.embed_tokens.weight", lambda w: w),
        "final_norm": ("model.norm.weight", lambda w: w),
    }
    if not config.tie_word_embeddings:
        tensors["lm_head"] = ("lm_head.weight", lambda w: w.T)
    return tensors


def safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index or the single file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({err})") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise WeightLoadError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    if not path.is_file():
        raise WeightLoadError(f"{path}: shard listed in the index is missing")
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as err:  # safetensors raises its own error type for bad headers
        raise WeightLoadError(f"{path}: not a valid safetensors file ({err})") from None


_SAFETENSORS_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
                       "F32": np.dtype(np.float32), "F64": np.dtype(np.float64)}


def checkpoint_dtype(folder: Path) -> np.dtype:
    """The floating dtype the checkpoint stores (for dtype='auto'), from a header: no tensor is read."""
    files = safetensors_files(folder)
    name = next((n for n in files if n.endswith("embed_tokens.weight")), next(iter(files)))
    with _open(files[name]) as f:
        stored = f.get_slice(name).get_dtype()
    if stored not in _SAFETENSORS_DTYPES:
        raise WeightLoadError(f"{files[name]}: tensor {name!r} is stored as {stored}; choose a float dtype")
    return _SAFETENSORS_DTYPES[stored]


def _read(handle, name: str, path: Path) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except Exception as err:
        raise WeightLoadError(f"{path}: cannot read tensor {name!r} ({err})") from None


def _read_quantized(handles, files: dict[str, Path], name: str, quant: CheckpointQuantization,
                    folder: Path) -> np.ndarray:
    """Tensor `name` of an FP8 checkpoint: float8 weights dequantised with their scales, the rest as stored."""
    try:
        w = read_fp8_weight(handles, files, name, quant)
    except (Fp8ScaleError, ValueError) as err:
        raise WeightLoadError(f"{folder}: {err}") from None
    return _read(handles[files[name]], name, files[name]) if w is None else w


# One param of the pytree: its key and, per layer (or once), a reader returning our layout.
ParamReaders = list[tuple[str, list[Callable[[], np.ndarray]]]]


def assemble_params(config: LlamaConfig, groups: ParamReaders, dtype: np.dtype, desc: str) -> Params:
    """Fill the params pytree one param at a time, each cast to `dtype` and put on the device.

    Only one stacked host buffer lives at a time, so peak host memory is the
    device copy plus the largest single param, never two full copies.
    """
    shapes = param_shapes(config)
    params: Params = {"layers": {}}
    with tqdm(total=sum(len(r) for _, r in groups), unit="tensor", leave=False, desc=desc) as bar:
        for key, readers in groups:
            stacked = key in shapes["layers"]
            buffer = np.empty(shapes["layers"][key] if stacked else shapes[key], dtype)
            for i, read in enumerate(readers):
                tensor = read()
                if tensor.shape != buffer.shape[stacked:]:
                    raise WeightLoadError(f"{desc}: {key}[{i}] has shape {tensor.shape}, the config "
                                          f"implies {buffer.shape[stacked:]}")
                buffer[i if stacked else ...] = tensor
                bar.update()
            (params["layers"] if stacked else params)[key] = jax.device_put(buffer)
            del buffer
    return params


def load_safetensors_params(folder: Path, config: LlamaConfig, dtype: np.dtype,
                            quant: CheckpointQuantization | None = None) -> Params:
    """Read a HF Llama checkpoint folder into the params pytree, cast to `dtype`, on device. quant: an FP8
    checkpoint's scheme (quant_config.py): its float8 weights are read times their scales
    (fp8_checkpoint.py)."""
    files = safetensors_files(folder)
    named = [(key, [(name, fn)]) for key, (name, fn) in _top_level_tensors(config).items()]
    named += [(key, [(name.format(i=i), fn) for i in range(config.num_hidden_layers)])
              for key, (name, fn) in _hf_layer_tensors(config).items()]
    missing = sorted({name for _, tensors in named for name, _ in tensors if name not in files})
    if missing:
        raise WeightLoadError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    shards = sorted(set(files.values()))
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in shards}

        def reader(name, fn):
            if quant is not None:
                return lambda: fn(_read_quantized(handles, files, name, quant, folder))
            return lambda: fn(_read(handles[files[name]], name, files[name]))

        groups = [(key, [reader(name, fn) for name, fn in tensors]) for key, tensors in named]
        return assemble_params(config, groups, dtype, f"Loading {len(shards)} safetensors shard(s)")
