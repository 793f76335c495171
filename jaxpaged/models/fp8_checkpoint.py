"""Reading an FP8 checkpoint's weights (`read_fp8_weight`): float8_e4m3fn tensors times their stored scales.

The checkpoint's scheme comes from `quant_config.parse_quantization_config`. A weight stored as F8_E4M3
[out, in] is read in place from its file (safetensors' numpy reader has no float8 type: the header gives
the tensor's bytes, mapped as ml_dtypes.float8_e4m3fn) and multiplied by its scale tensor (`weight_scale`
or `weight_scale_inv`) in float32: one value (per tensor), [out, 1] or [out] (per output channel), or
[ceil(out / b0), ceil(in / b1)] (blocks). The loader then casts it to the model's dtype like any other
tensor, and `--quantization fp8` (implied by the checkpoint) rounds it to e4m3 again per output channel
(jaxpaged/models/fp8.py): a per-channel checkpoint's values come back as stored, a per-tensor or block one's
are re-rounded on a finer or coarser grid (docs/quantization.md).
A missing, non-finite or mis-shaped scale is a WeightLoadError naming the tensor, raised while loading.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxpaged.models.quant_config import CheckpointQuantization

F8_E4M3 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


class Fp8ScaleError(ValueError):
    """An FP8 weight's scale is missing, mis-shaped or not a positive finite number."""


def read_raw_f8(path: Path, name: str) -> np.ndarray:
    """Tensor `name` of safetensors file `path`, stored as F8_E4M3, as a read-only float8_e4m3fn array mapped from
    the file (no copy)."""
    with Path(path).open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    info = header[name]
    if info["dtype"] != F8_E4M3:
        raise ValueError(f"{path}: tensor {name!r} is {info['dtype']}, not {F8_E4M3}")
    begin, end = info["data_offsets"]
    if end - begin != int(np.prod(info["shape"], dtype=np.int64)):
        raise ValueError(f"{path}: tensor {name!r} holds {end - begin} bytes for shape {info['shape']}")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
    return data.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def dequantize(q: np.ndarray, scale: np.ndarray, quant: CheckpointQuantization, name: str) -> np.ndarray:
    """q float8_e4m3fn [out, in] (or [n] for a 1-D tensor) times `scale` as `quant` lays it out -> float32."""
    scale = np.asarray(scale, np.float32)
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        raise Fp8ScaleError(f"{name}: scale {quant.scale_name} holds values that are not positive finite numbers")
    w = q.astype(np.float32)
    if quant.strategy == "tensor" or scale.size == 1:
        if scale.size != 1:
            raise Fp8ScaleError(f"{name}: a per-tensor scale must be one value, got shape {scale.shape}")
        return w * scale.reshape(())
    out = w.shape[0]
    if quant.strategy == "channel":
        if scale.shape not in ((out, 1), (out,)):
            raise Fp8ScaleError(f"{name}: a per-channel scale of a weight {list(w.shape)} must be [{out}, 1], got "
                                f"{list(scale.shape)}")
        return w * scale.reshape((out,) + (1,) * (w.ndim - 1))
    b0, b1 = quant.block_size
    if w.ndim != 2:
        raise Fp8ScaleError(f"{name}: block scales need a 2-D weight, got {list(w.shape)}")
    want = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
    if scale.shape != want:
        raise Fp8ScaleError(f"{name}: block scales ({b0} x {b1}) of a weight {list(w.shape)} must be {list(want)}, "
                            f"got {list(scale.shape)}")
    full = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[:w.shape[0], :w.shape[1]]
    return w * full


def read_fp8_weight(handles: dict, files: dict[str, Path], name: str,
                    quant: CheckpointQuantization) -> np.ndarray | None:
    """Tensor `name` dequantised to float32 when it is stored as F8_E4M3 (with its scale beside it), else None.
    handles: file -> open safetensors handle; files: tensor name -> file (weights.safetensors_files)."""
    path = files[name]
    if handles[path].get_slice(name).get_dtype() != F8_E4M3:
        return None
    scale_name = name.removesuffix("weight") + quant.scale_name if name.endswith("weight") else None
    if scale_name is None or scale_name not in files:
        raise Fp8ScaleError(f"{name} is stored as float8_e4m3fn but the checkpoint has no {scale_name or 'scale'} "
                            f"tensor ({quant.format}, {quant.strategy} scales)")
    scale_handle = handles[files[scale_name]]
    if scale_handle.get_slice(scale_name).get_dtype() == F8_E4M3:
        raise Fp8ScaleError(f"{scale_name}: the scale is stored as float8; float32/bfloat16/float16 expected")
    return dequantize(read_raw_f8(path, name), scale_handle.get_tensor(scale_name), quant, name)
