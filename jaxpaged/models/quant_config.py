"""What a checkpoint's `config.json` says about its quantisation: `parse_quantization_config(hf)`.

Two FP8 formats load (the field names are the formats' own):
  - compressed-tensors (`quant_method` "compressed-tensors", `format` "float-quantized"): `config_groups`, each
    with `weights` {num_bits 8, type "float", strategy "tensor" | "channel"} and maybe `input_activations`;
    `ignore` lists modules left in full precision; `kv_cache_scheme` (or None) says whether the attention
    layers carry `k_scale` / `v_scale` tensors. Weight tensors are float8_e4m3fn [out, in], each with a
    `weight_scale` tensor: one value (per tensor) or [out, 1] (per output channel); w = q * weight_scale.
  - Hugging Face's `fp8` (`quant_method` "fp8", as published for Llama 3.1 / Qwen3 FP8 and DeepSeek-V3):
    `weight_block_size` [block_out, block_in] (128 x 128), `activation_scheme` "dynamic",
    `modules_to_not_convert` (or `ignored_layers`); each weight [out, in] float8_e4m3fn with
    `weight_scale_inv` [ceil(out / block_out), ceil(in / block_in)]; w = q * weight_scale_inv over each block.
Any other `quant_method` or format is an UnsupportedModelError naming it; a checkpoint without
`quantization_config` is full precision (None).

The fp8 KV cache reads `CheckpointQuantization.kv_cache_scheme` (the checkpoint's k/v scales, if any).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpaged.models.llama import UnsupportedModelError

WEIGHT_STRATEGIES = ("tensor", "channel", "block")  # CheckpointQuantization.strategy


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """An FP8 checkpoint's scheme. format: "compressed-tensors" or "fp8" (Hugging Face's block format);
    strategy: how `weight_scale` / `weight_scale_inv` cover a weight [out, in]: "tensor" (one value),
    "channel" ([out, 1]) or "block" ([ceil(out / b0), ceil(in / b1)] for block_size (b0, b1));
    scale_name: the scale tensor's suffix beside each `.weight`; ignore: module names (or compressed-tensors'
    "re:" patterns) left unquantised; kv_cache_scheme: compressed-tensors' dict as given (None: no KV
    scales in the checkpoint)."""

    format: str
    strategy: str
    scale_name: str
    block_size: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    activation_dynamic: bool = True
    kv_cache_scheme: Mapping[str, Any] | None = None

    def __post_init__(self):
        if self.strategy not in WEIGHT_STRATEGIES:
            raise UnsupportedModelError(f"quantization_config ({self.format}): weight strategy "
                                        f"{self.strategy!r} is not supported (supported: {WEIGHT_STRATEGIES})")
        if (self.strategy == "block") != (self.block_size is not None):
            raise UnsupportedModelError(f"quantization_config ({self.format}): a block strategy needs a block size "
                                        f"and only it has one (strategy {self.strategy!r}, block {self.block_size})")


def parse_quantization_config(hf: Mapping[str, Any]) -> CheckpointQuantization | None:
    """config.json's `quantization_config` as a CheckpointQuantization; None when there is none."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedModelError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise UnsupportedModelError(f"config.json: quantization_config quant_method={method!r} is not supported "
                                "(FP8 checkpoints load in the formats 'compressed-tensors' (float-quantized) and "
                                "'fp8'; others: use a full-precision checkpoint, or --quantization)")


def _hf_fp8(qc: Mapping[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"quantization_config (fp8): fmt={fmt!r} is not supported (e4m3 only)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError("quantization_config (fp8): activation_scheme="
                                    f"{qc.get('activation_scheme')!r} is not supported (dynamic only)")
    if qc.get("scale_fmt", "float") != "float":
        raise UnsupportedModelError(f"quantization_config (fp8): scale_fmt={qc.get('scale_fmt')!r} is not "
                                    "supported (float scales only)")
    block = qc.get("weight_block_size")
    if block is None:  # no block size: one scale per tensor
        return CheckpointQuantization("fp8", "tensor", "weight_scale_inv", ignore=_names(qc, "fp8"))
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(f"quantization_config (fp8): weight_block_size={block!r} must be two "
                                    "positive integers")
    return CheckpointQuantization("fp8", "block", "weight_scale_inv", tuple(block), _names(qc, "fp8"))


def _names(qc: Mapping[str, Any], fmt: str) -> tuple[str, ...]:
    names = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore") or ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UnsupportedModelError(f"quantization_config ({fmt}): the modules left unquantised must be a list "
                                    f"of names, got {names!r}")
    return tuple(names)


def _compressed_tensors(qc: Mapping[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise UnsupportedModelError(f"quantization_config (compressed-tensors): format={fmt!r} is not supported "
                                    "(FP8 'float-quantized' only)")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise UnsupportedModelError("quantization_config (compressed-tensors): no config_groups")
    schemes = {_weight_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise UnsupportedModelError("quantization_config (compressed-tensors): config groups with different weight "
                                    f"schemes are not supported ({sorted(schemes)})")
    (strategy, block, dynamic), = schemes
    kv = qc.get("kv_cache_scheme")
    kv = dict(kv) if isinstance(kv, Mapping) else None
    return CheckpointQuantization("compressed-tensors", strategy, "weight_scale", block,
                                  _names(qc, "compressed-tensors"), dynamic, kv)


def _weight_scheme(name: str, group: Any) -> tuple[str, tuple[int, int] | None, bool]:
    """(strategy, block size, dynamic activations) of one config group; FP8 weights only."""
    where = f"quantization_config (compressed-tensors) config_groups[{name!r}]"
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        raise UnsupportedModelError(f"{where}: no 'weights' scheme")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedModelError(f"{where}: weights type={weights.get('type')!r} num_bits="
                                    f"{weights.get('num_bits')!r} is not supported (FP8: float, 8 bits)")
    if weights.get("dynamic"):
        raise UnsupportedModelError(f"{where}: dynamic weight scales are not supported (the scales must be stored)")
    strategy = weights.get("strategy")
    block = weights.get("block_structure")
    if strategy == "block":
        block = tuple(block) if isinstance(block, (list, tuple)) and len(block) == 2 else None
        if block is None:
            raise UnsupportedModelError(f"{where}: a block strategy needs block_structure [out, in]")
    elif strategy not in ("tensor", "channel"):
        raise UnsupportedModelError(f"{where}: weight strategy {strategy!r} is not supported "
                                    f"(supported: {WEIGHT_STRATEGIES})")
    else:
        block = None
    acts = group.get("input_activations")  # static input scales are not used: activations scale per token
    return strategy, block, not isinstance(acts, Mapping) or bool(acts.get("dynamic", True))
