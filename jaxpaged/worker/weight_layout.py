"""The step's weight layout: which one (`resolve_weight_layout`) and the conversion to it (`to_weight_layout`).

Checkpoints load stacked ({name: [L, ...]}) and unfused (wq, wk, wv, w_gate, w_up), the layout
`jaxpaged/models/llama.py` documents. The engine's step may instead hold (`WeightLayout`):
  - per-layer arrays ("layers" a list of L dicts): the step's Python loop reads each layer's weights
    in place. A `lax.scan` over the stack slices them at run time, and the compiled program then
    holds a dynamic slice per weight (XLA:GPU copies it before a cuBLAS gemm unless dynamic-slice
    fusion applies: each weight byte read, written and read again). tests/test_weight_layout.py
    checks the compiled CPU step and the CUDA lowering for those slices. The price is compile time:
    L layers compiled instead of one (the persistent compilation cache keeps it to the first start).
  - fused projections: wqkv [E, K, G + 2, D] and w_gate_up [E, 2, F], one gemm each instead of three
    and two, on the same input.
"auto" (RunnerConfig.weight_layout, EngineArgs.weight_layout) picks per-layer weights on GPU, and on CPU
where the weights are not packed: there the scan's slices are copied too (at 2-32 rows the dot reads a
copy of each weight) and the per-layer step ran ~10% faster at every shape measured (SmolLM2 f32: batch-1
decode 19.4 -> 17.4 ms, batch 32 83.9 -> 75.4 ms, a 256-token prefill 178 -> 162 ms). Float32 weights on
CPU are packed as the native matmul's column blocks (`model_runner.packs_weights`), and a stack of those is
read in place by layer index (`weight_dots.PackedWeight.at_layer`): nothing is sliced, so "auto" scans them there
(the same step times with one layer compiled: docs/performance.md, "Which knobs matter"). "stacked" keeps the
scan everywhere (fast cold starts, e.g. for short-lived test engines). Fusing was neutral on CPU and is on
everywhere.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from jaxpaged.models.llama import LlamaConfig, Params
from jaxpaged.models.params import UNFUSED, WeightLayout, fuse_gate_up, fuse_qkv
from jaxpaged.worker import parallel

WEIGHT_LAYOUTS = ("auto", "stacked", "per_layer")
PER_LAYER_PLATFORMS = ("cpu", "gpu", "cuda", "rocm")  # where "auto" picks per-layer weights


def check_weight_layout(weight_layout: str) -> None:
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r}: choose one of {WEIGHT_LAYOUTS}")


def resolve_weight_layout(weight_layout: str, fuse_projections: bool, platform: str,
                          packed: bool = False) -> WeightLayout:
    """The layout the step runs on `platform` ("cpu", "gpu", ...) for the configured choice; packed: the
    runner packs the weight dots' weights (`model_runner.packs_weights`), whose stack a scan reads in place."""
    check_weight_layout(weight_layout)
    per_layer = weight_layout == "per_layer" or (weight_layout == "auto" and platform in PER_LAYER_PLATFORMS
                                                 and not packed)
    return WeightLayout(per_layer=per_layer, fused=bool(fuse_projections))


def _fusions(config: LlamaConfig) -> dict[str, tuple[tuple[str, ...], object]]:
    """Fused name -> (the checkpoint's names it replaces, fn(*those arrays) -> the fused array)."""
    return {"wqkv": (UNFUSED["wqkv"], functools.partial(fuse_qkv, config)),
            "w_gate_up": (UNFUSED["w_gate_up"], fuse_gate_up)}


def to_weight_layout(config: LlamaConfig, params: Params, layout: WeightLayout, mesh: Mesh | None = None, *,
                     consume: bool = False) -> Params:
    """`params` (the checkpoint layout) in `layout`, placed on the mesh's shardings when one is given.

    Params already in `layout` come back as they are. One group of tensors converts at a time;
    consume=True deletes each source array once converted (the caller's params become unusable), so
    device memory peaks at the weights plus one group rather than twice the weights.
    """
    current = WeightLayout.of(params)
    if current == layout:
        return params
    if current != WeightLayout():
        raise ValueError(f"params are in {current}; only the checkpoint layout (stacked, unfused) converts "
                         f"to {layout}")
    fused_shardings = None if mesh is None else \
        parallel.param_shardings(config, mesh, WeightLayout(fused=layout.fused))["layers"]
    source, stacked, owned = dict(params["layers"]), {}, set()
    for name, (names, fuse) in (_fusions(config) if layout.fused else {}).items():
        group = [source.pop(n) for n in names]
        placed = jax.jit(fuse) if mesh is None else jax.jit(fuse, out_shardings=fused_shardings[name])
        stacked[name] = placed(*group)
        owned.add(name)
        if consume:
            _delete(group)
    stacked.update(source)
    if consume:
        owned.update(source)
    layers: Params | list[Params] = stacked
    if layout.per_layer:
        layers = _split_layers(config, stacked, owned, mesh, layout)
    return dict(params, layers=layers)


def _split_layers(config: LlamaConfig, stacked: Params, owned: set[str], mesh: Mesh | None,
                  layout: WeightLayout) -> list[Params]:
    """{name: [L, ...]} -> L dicts of {name: [...]}, deleting each stacked array in `owned` once split."""
    num_layers = config.num_hidden_layers
    layers: list[Params] = [{} for _ in range(num_layers)]
    shardings = None if mesh is None else parallel.param_shardings(config, mesh, layout)["layers"]
    for name in list(stacked):
        x = stacked.pop(name)
        if shardings is None:  # one device: a slice per layer, each its own buffer
            parts = [x[i] for i in range(num_layers)]
        else:  # a mesh (maybe several processes): one program that places every layer's shards
            parts = jax.jit(lambda a: tuple(a[i] for i in range(num_layers)),
                            out_shardings=tuple(s[name] for s in shardings))(x)
        for layer, part in zip(layers, parts):
            layer[name] = part
        if name in owned:
            _delete([x])
    return layers


def _delete(arrays) -> None:
    for a in arrays:
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()
