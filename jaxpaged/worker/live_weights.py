"""Live weights by Hugging Face name: the runner's params read out as, and replaced from, {HF name: array}.

`LiveWeights` (a ModelRunner base) holds `update_weights` and `get_weights`, `RunnerSleep` holds `sleep` and
`wake_up`; docs/rl.md gives their contract (names, arrays on the host or the device, the engine's own layout
kept so nothing compiles again, everything checked before anything changes). Where the weights are quantised,
get -> update is still the identity: int8 re-quantises its dequantised values to the same values, fp8
(quantised anew by `fp8.quantizer`'s program, as at load) to within a float32 ulp of its scale.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models import fp8
from jaxpaged.models.fp8 import Fp8Weight
from jaxpaged.models.llama import LlamaConfig, Params, split_qkv
from jaxpaged.models.params import UNFUSED, fuse_gate_up, fuse_qkv, param_shapes
from jaxpaged.models.weight_dots import PackedWeight, dot_view
from jaxpaged.models.weights import _hf_layer_tensors, _top_level_tensors
from jaxpaged.worker.host_memory import (
    HugePageArena,
    advise_zeroed_huge_pages,
    cpu_array_over,
)
from jaxpaged.worker.step_input import allocate_kv_pool
from jaxpaged.worker.step_program import _pack_for_cpu_matmul
from pallas_kernels import cpu_matmul


class WeightUpdateError(ValueError):
    """Weights that cannot replace the engine's (unknown name, wrong shape, not float, not finite); nothing
    was changed."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: our checkpoint-layout param `key`, its `layer` (None: not a layer weight),
    the HF tensor's `shape`, and `to_ours`: HF tensor -> our one-layer layout (the safetensors loader's)."""
    key: str
    layer: int | None
    shape: tuple[int, ...]
    to_ours: Callable[[Any], Any]


def _transposed(x):
    return x.T


def _flat_in(x):  # wq/wk/wv [E, H, D] -> HF [H * D, E]
    return x.reshape(x.shape[0], -1).T


def _flat_out(x):  # wo [H, D, E] -> HF [E, H * D]
    return x.reshape(-1, x.shape[-1]).T


def _flat(x):  # bq/bk/bv [H, D] -> HF [H * D]
    return x.reshape(-1)


# our one-layer layout -> the HF tensor (the inverse of weights.py's layouts); absent: the same array
_TO_HF = {"wq": _flat_in, "wk": _flat_in, "wv": _flat_in, "wo": _flat_out, "w_gate": _transposed,
          "w_up": _transposed, "w_down": _transposed, "lm_head": _transposed, "bq": _flat, "bk": _flat, "bv": _flat}


def to_hf(key: str, x):
    """One layer's (or a top-level) param `key` in our layout -> the HF tensor (numpy or jax, as given)."""
    return _TO_HF.get(key, lambda a: a)(x)


@functools.lru_cache(maxsize=8)
def hf_slots(config: LlamaConfig) -> dict[str, Slot]:
    """Every HF parameter name of the model -> its Slot (the safetensors loader's names and layouts)."""
    shapes = param_shapes(config)
    slots = {}
    for key, (name, fn) in _top_level_tensors(config).items():
        slots[name] = Slot(key, None, to_hf(key, np.empty(shapes[key], np.int8)).shape, fn)
    for key, (template, fn) in _hf_layer_tensors(config).items():
        shape = to_hf(key, np.empty(shapes["layers"][key][1:], np.int8)).shape
        for i in range(config.num_hidden_layers):
            slots[template.format(i=i)] = Slot(key, i, shape, fn)
    return slots


def check_weights(config: LlamaConfig, weights: Mapping[str, Any]) -> dict[str, Any]:
    """`weights` checked against the model's names and shapes: {name: numpy or jax array}; WeightUpdateError
    (naming the first few offenders) for unknown names, wrong shapes, non-float dtypes or non-finite values."""
    if not isinstance(weights, Mapping):
        raise WeightUpdateError(f"weights must map Hugging Face parameter names to arrays; got "
                                f"{type(weights).__name__}")
    slots = hf_slots(config)
    unknown = sorted(n for n in weights if n not in slots)
    if unknown:
        raise WeightUpdateError(f"{len(unknown)} unknown parameter name(s), e.g. {unknown[:3]}; this model's names "
                                f"are like {list(slots)[:2]} ({len(slots)} in all)")
    arrays, wrong = {}, []
    for name, x in weights.items():
        if not isinstance(x, (np.ndarray, jax.Array)):
            try:
                x = np.asarray(x)
            except Exception as err:  # an object numpy cannot read (a bfloat16 torch tensor, ...)
                raise WeightUpdateError(f"{name}: not an array numpy or JAX can read ({type(x).__name__}: "
                                        f"{err})") from None
        if tuple(x.shape) != slots[name].shape or not _is_float(x.dtype):
            wrong.append(f"{name}: {np.dtype(x.dtype).name}{list(x.shape)}, expected float{list(slots[name].shape)}")
        arrays[name] = x
    if wrong:
        raise WeightUpdateError(f"{len(wrong)} tensor(s) of the wrong shape or dtype: {'; '.join(wrong[:3])}")
    bad = [n for n, x in arrays.items() if not _all_finite(x)]
    if bad:
        raise WeightUpdateError(f"{len(bad)} tensor(s) hold NaN or infinite values, e.g. {bad[:3]}")
    return arrays


def _off_host(x) -> bool:
    """Whether x lives on an accelerator (converted there with jax.numpy); a CPU jax.Array is read in place by
    numpy (no copy), as fast as the host path and with no program to compile."""
    return isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices())


def _is_float(dtype) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))  # bfloat16 too (numpy's issubdtype says no)
    except TypeError:  # a dtype JAX does not know (strings, objects)
        return False


def _all_finite(x) -> bool:
    if _off_host(x):
        return bool(jnp.isfinite(x).all())
    return bool(np.isfinite(np.asarray(x)).all())


# ----------------------------------------------------------------------------- engine leaves

# An engine leaf's address: (name, None) a top-level param, (name, "stacked") a [L, ...] layer stack,
# (name, i) layer i's own array (per-layer layout)
Address = tuple[str, Any]


def _addresses(params: Params) -> list[Address]:
    top = [(name, None) for name in params if name != "layers"]
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return top + [(name, i) for i, layer in enumerate(layers) for name in layer]
    return top + [(name, "stacked") for name in layers]


def _leaf(params: Params, address: Address):
    name, where = address
    if where is None:
        return params[name]
    return params["layers"][name] if where == "stacked" else params["layers"][where][name]


def _with_leaves(params: Params, new: dict[Address, Any]) -> Params:
    """`params` with the leaves at `new`'s addresses replaced (the containers copied, the other leaves shared)."""
    out = dict(params)
    layers = params["layers"]
    out["layers"] = [dict(layer) for layer in layers] if isinstance(layers, (list, tuple)) else dict(layers)
    for (name, where), value in new.items():
        if where is None:
            out[name] = value
        elif where == "stacked":
            out["layers"][name] = value
        else:
            out["layers"][where][name] = value
    return out


def _sources(config: LlamaConfig, name: str) -> tuple[str, ...]:
    """The checkpoint-layout params an engine leaf is made of (a tied model's LM head copy: the embedding)."""
    if name == "lm_head" and config.tie_word_embeddings:
        return ("embed",)
    return UNFUSED.get(name, (name,))


def _layer_shape(config: LlamaConfig, name: str) -> tuple[int, ...]:
    """One layer's (or a top-level param's) shape of an engine leaf, unpacked."""
    shapes = param_shapes(config, fused=True)
    if name in shapes["layers"]:
        return shapes["layers"][name][1:]
    if name == "lm_head":
        return (config.hidden_size, config.vocab_size)
    return shapes[name]


def _dense(config: LlamaConfig, name: str, leaf, layer: int | None = None):
    """An engine leaf as a plain array of its unpacked shape ((L,) + `_layer_shape`): itself, or a packed
    weight's blocks [(L,) N / 64, K, 64] read back on the host (int8: dequantised). layer: only that layer of a
    packed stack."""
    if isinstance(leaf, Fp8Weight):
        q, scale = (leaf.q, leaf.scale) if layer is None else (leaf.q[layer], leaf.scale[layer])
        w2 = np.asarray(fp8.dequantize(q, scale))  # [(L,) K, N]
        return w2.reshape(*w2.shape[:-2], *_layer_shape(config, name))
    if not isinstance(leaf, PackedWeight):
        return leaf
    data = np.asarray(leaf.data) if layer is None else np.asarray(leaf.data)[layer]
    *lead, blocks, k, cols = data.shape
    w2 = data.swapaxes(-3, -2).reshape(*lead, k, blocks * cols)  # [(L,) K, N]: block_weight undone
    if leaf.scale is not None:
        scale = np.asarray(leaf.scale) if layer is None else np.asarray(leaf.scale)[layer]
        scale = scale.swapaxes(-3, -2).reshape(*lead, scale.shape[-2], blocks * cols)
        w2 = np.asarray(cpu_matmul.dequantize_int8(w2, scale))
    return w2.reshape(*lead, *_layer_shape(config, name))


def _split(config: LlamaConfig, name: str, dense) -> dict[str, Any]:
    """An unpacked engine leaf -> its checkpoint-layout params (fused projections taken apart)."""
    if name == "wqkv":  # [..., E, K, G + 2, D]
        return dict(zip(UNFUSED["wqkv"], split_qkv(config, dense)))
    if name == "w_gate_up":  # [..., E, 2, F]
        return {"w_gate": dense[..., 0, :], "w_up": dense[..., 1, :]}
    if name == "lm_head" and config.tie_word_embeddings:
        return {}  # the embedding's copy: read as the embedding
    return {name: dense}


def _join(config: LlamaConfig, name: str, parts: dict[str, Any], xp):
    """Checkpoint-layout params -> an engine leaf's unpacked array, with numpy or jax.numpy (`xp`)."""
    if name == "wqkv":
        return fuse_qkv(config, parts["wq"], parts["wk"], parts["wv"], xp)
    if name == "w_gate_up":
        return fuse_gate_up(parts["w_gate"], parts["w_up"], xp)
    if name == "lm_head" and config.tie_word_embeddings:
        return xp.swapaxes(parts["embed"], -1, -2)
    return parts[name]


class LiveWeights:
    """ModelRunner's `update_weights` and `get_weights` (module docstring); they share its state."""

    def get_weights(self) -> dict[str, np.ndarray]:
        """Every weight under its Hugging Face name: host numpy copies, the engine's dtype, HF's layout."""
        config, slots = self.model_config, hf_slots(self.model_config)
        names = {(s.key, s.layer): n for n, s in slots.items()}
        out = {}
        for address in _addresses(self.params):
            name, where = address
            _check_form(address, _leaf(self.params, address))
            for key, x in _split(config, name, _dense(config, name, _leaf(self.params, address))).items():
                x = np.asarray(x)
                if where == "stacked":
                    out.update((names[key, i], np.array(to_hf(key, x[i]))) for i in range(x.shape[0]))
                else:
                    out[names[key, where]] = np.array(to_hf(key, x))
        return {n: out[n] for n in slots}

    def update_weights(self, weights: Mapping[str, Any]) -> int:
        """Replace the named weights (module docstring); returns how many tensors were given. WeightUpdateError,
        changing nothing, for a bad dict. The new weights take effect from the next step dispatched; a step
        already dispatched holds the old arrays and finishes with them."""
        _one_process(self, "update_weights")
        config, slots = self.model_config, hf_slots(self.model_config)
        arrays = check_weights(config, weights)
        given: dict[str, dict[int | None, Any]] = {}  # checkpoint key -> {layer: the HF array}
        for name, x in arrays.items():
            given.setdefault(slots[name].key, {})[slots[name].layer] = x if _off_host(x) else np.asarray(x)
        to_ours = {slot.key: slot.to_ours for slot in slots.values()}
        touched = [(address, _sources(config, address[0])) for address in _addresses(self.params)]
        touched = [(address, sources) for address, sources in touched
                   if any(k in given and (address[1] in (None, "stacked") or address[1] in given[k]) for k in sources)]
        for address, _ in touched:
            _check_form(address, _leaf(self.params, address))
        new = {address: self._rebuilt(address, sources, given, to_ours) for address, sources in touched}
        self.params = _with_leaves(self.params, new)  # all or nothing: nothing above changed the runner
        return len(arrays)

    def _rebuilt(self, address: Address, sources: tuple[str, ...], given, to_ours):
        """The engine leaf at `address` made anew from the `given` HF arrays ({key: {layer: array}}) over the
        current values of the parts they leave out."""
        config, (name, where) = self.model_config, address
        old = _leaf(self.params, address)
        if where == "stacked" and isinstance(old, PackedWeight):
            return self._repacked(name, old, sources, given, to_ours)
        inputs = [x for k in sources for i, x in given.get(k, {}).items() if where in (None, "stacked") or i == where]
        xp = jnp if any(_off_host(x) for x in inputs) else np
        dtype = np.float32 if isinstance(old, (PackedWeight, Fp8Weight)) else old.dtype
        current, parts = None, {}
        for key in sources:
            layers = given.get(key, {})
            complete = len(layers) == config.num_hidden_layers if where == "stacked" else where in layers
            if not complete and current is None:
                current = _split(config, name, _dense(config, name, old))
            if where == "stacked":
                parts[key] = _stacked(xp, dtype, to_ours[key], layers, None if complete else current[key])
            else:
                parts[key] = to_ours[key](layers[where]) if complete else current[key]
        return self._placed(name, _join(config, name, parts, xp), old)

    def _placed(self, name: str, dense, old):
        """An engine leaf's new unpacked value in the form and place of `old`: packed alike (a fresh host
        arena) or put on `old`'s sharding in its dtype."""
        if isinstance(old, PackedWeight):
            return self._packed(name, dense, old)
        if isinstance(old, Fp8Weight):  # quantised anew, as at load: same shapes, dtypes and device
            return fp8.quantizer(old.gemm)(jnp.asarray(self._two_d(name, dense), jnp.float32), old.shape)
        dense = np.asarray(dense, old.dtype) if isinstance(dense, np.ndarray) else dense.astype(old.dtype)
        return _put_like(dense, old, self.mesh)  # a copy: never the caller's own array

    def _two_d(self, name: str, dense):
        """An unpacked weight ((L,) + one layer's shape) as its dot's 2-D view [(L,) K, N] (weight_dots.dot_view)."""
        return dot_view(name, dense, dense.ndim - len(_layer_shape(self.model_config, name)))

    def _packed(self, name: str, dense, old: PackedWeight) -> PackedWeight:
        """dense ((L,) + one layer's unpacked shape) as the native matmul's blocks, as `old` was packed."""
        view = self._two_d(name, np.asarray(dense, np.float32))
        packed = _pack_for_cpu_matmul(view, old.shape, HugePageArena(view.nbytes),
                                      quantization=self.config.quantization)
        if packed is None or (packed.scale is None) != (old.scale is None):
            raise RuntimeError(f"{name}: the new weight does not pack as the old one did")
        return packed

    def _repacked(self, name: str, old: PackedWeight, sources, given, to_ours) -> PackedWeight:
        """A packed layer stack made anew a layer at a time: a layer no given tensor touches keeps its blocks
        (copied as they are); the others are assembled in one layer's scratch buffer (fused parts joined,
        missing parts read back from `old`) and blocked (int8: quantised) straight into the new stack, as
        `_pack_for_cpu_matmul` blocks a stack. No stacked temporary: the stack's bytes are written about once."""
        config = self.model_config
        data = np.asarray(old.data)  # [L, N / 64, K, 64]
        blocks = HugePageArena(data.nbytes).empty(data.shape, data.dtype)
        old_scale = None if old.scale is None else np.asarray(old.scale)  # [L, N / 64, K / 32, 64]
        scale = None if old_scale is None else np.empty(old_scale.shape, np.float32)
        scratch = np.empty(_layer_shape(config, name), np.float32)  # one layer, unpacked
        view = scratch.reshape(-1, scratch.shape[-1]) if name == "wo" else scratch.reshape(scratch.shape[0], -1)
        for i in range(config.num_hidden_layers):
            if not any(i in given.get(key, {}) for key in sources):
                np.copyto(blocks[i], data[i])
                if scale is not None:
                    np.copyto(scale[i], old_scale[i])
                continue
            current, parts = None, {}
            for key in sources:
                if i in given.get(key, {}):
                    parts[key] = to_ours[key](np.asarray(given[key][i]))
                else:
                    current = current or _split(config, name, _dense(config, name, old, i))
                    parts[key] = current[key]
            np.copyto(scratch, _join(config, name, parts, np))  # a layer's temporary at most
            if scale is None:
                np.copyto(blocks[i], cpu_matmul.block_weight(view))
            else:
                q, s = cpu_matmul.quantize_int8(view)
                np.copyto(blocks[i], cpu_matmul.block_weight(q))
                np.copyto(scale[i], cpu_matmul.block_weight(s))
        return dataclasses.replace(old, data=cpu_array_over(blocks),
                                   scale=None if scale is None else jnp.asarray(scale))


_FLOATS = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _check_form(address: Address, leaf) -> None:
    """NotImplementedError for an engine leaf in a form this module does not convert (another quantised form):
    raised before anything changes, rather than writing floats where the step reads something else."""
    if isinstance(leaf, (PackedWeight, Fp8Weight)) or (isinstance(leaf, jax.Array) and np.dtype(leaf.dtype) in _FLOATS):
        return
    form = f"{type(leaf).__name__} {getattr(leaf, 'dtype', '')}".strip()
    raise NotImplementedError(f"live weights: the engine holds {address[0]} as {form}, which update_weights and "
                              "get_weights do not convert yet")


def _one_process(runner, what: str) -> None:
    """A multi-process run's other processes replay process 0's steps and would keep their old weights and pool."""
    if runner.multi_process:
        raise NotImplementedError(f"{what} runs in one process; this engine spans {jax.process_count()} processes")


def _put_like(x, old, mesh, may_alias: bool = False) -> jax.Array:
    """x placed as `old` is: on a mesh its sharding (committed); on one device the default device, uncommitted as
    the runner's own arrays are (a committed array would be another jit signature: a step compiled again).
    may_alias=False: a copy, never the caller's array itself (a trainer may donate or delete it afterwards)."""
    if mesh is None:
        return jax.device_put(x, may_alias=may_alias)
    return jax.device_put(x, old.sharding, may_alias=may_alias)


def _stacked(xp, dtype, to_ours, layers: dict[int, Any], current):
    """One checkpoint-layout param's [L, ...] stack (numpy or jax.numpy, `xp`): the given HF arrays (`layers`:
    {layer: array}) in our layout, over `current` (the param now; None when `layers` has every layer)."""
    if xp is np:
        out = np.array(current, dtype) if current is not None else \
            np.empty((len(layers), *to_ours(layers[0]).shape), dtype)
        for i, x in layers.items():
            out[i] = to_ours(np.asarray(x))
        return out
    if current is None:
        return jnp.stack([jnp.asarray(to_ours(layers[i]), dtype) for i in range(len(layers))])
    out = jnp.asarray(current, dtype)
    for i, x in layers.items():
        out = out.at[i].set(jnp.asarray(to_ours(x), dtype))
    return out


class RunnerSleep:
    """ModelRunner's `sleep` and `wake_up` (module docstring); they share its state."""

    sleep_level: int = 0  # 0 awake; 1 the KV pool freed; 2 the weights too
    _host_params: tuple | None = None  # level 2: (treedef, [(host copy, the deleted array) or (the leaf, None)])

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool's device buffers (level 1; their contents are lost) and, level 2, the weights'
        (kept on the host for `wake_up`). The caller makes sure no step is in flight."""
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level={level!r}: choose 1 (the KV cache) or 2 (the KV cache and the weights)")
        _one_process(self, "sleep")
        if self.sleep_level:
            raise RuntimeError(f"the runner is already asleep (level {self.sleep_level}); wake_up() first")
        jax.block_until_ready(self.kv)
        for buffer in jax.tree.leaves(self.kv):
            buffer.delete()
        self.kv = None
        if level == 2:
            leaves, treedef = jax.tree.flatten(self.params)
            kept = [(np.array(x), x) if isinstance(x, jax.Array) else (x, None) for x in leaves]
            for x in leaves:
                if isinstance(x, jax.Array):
                    x.delete()
            self._host_params, self.params = (treedef, kept), None
        self.sleep_level = level

    def wake_up(self) -> None:
        """A zeroed KV pool of the same shape, and the weights back on their devices (level 2)."""
        if not self.sleep_level:
            return
        if self._host_params is not None:
            treedef, kept = self._host_params
            self.params = jax.tree.unflatten(treedef, [x if old is None else _put_like(x, old, self.mesh, True)
                                                       for x, old in kept])
            self._host_params = None
        self.kv = allocate_kv_pool(self.model_config, self.config.num_pages, self.config.page_size, self.kv_dtype,
                                   self.mesh)
        if self.mesh is None:
            advise_zeroed_huge_pages(self.kv)
        self.sleep_level = 0
