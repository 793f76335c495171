"""The records a step program takes and returns: its input arrays and the KV pool (the fused step's sampler inputs
are a `SamplingBatch`, jaxpaged/sample/sampling_batch.py).

Shapes, as made by `ModelRunner.prepare` (T tokens, S sequence slots, P pages per sequence):
    StepInput: token_ids, positions, slot_mapping i32[T]; page_table i32[S, P]; kv_lens i32[S]; cu_q_lens i32[S + 1]
    KVPool: k, v [L, K, N, page_size, D] (stacked over layers; N pages, page 0 the null page); an fp8 pool holds
        e4m3 bytes (uint8) and its k_scale, v_scale f32 [L, K] (per layer and KV head: pallas_kernels/kv_quant.py),
        None for a float pool
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.models.llama import LlamaConfig
from jaxpaged.sample import sampler
from jaxpaged.sample.sampling_batch import SamplingBatch
from jaxpaged.worker import parallel
from pallas_kernels import kv_quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [L, K, N, page_size, D]
    v: jax.Array
    # an fp8 pool's scales, f32 [L, K] each (jaxpaged/worker/kv_scales.py): step inputs like the pages, never
    # changed by a step; None for a float pool
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """One padded step. Padding tokens write to the null page and are not attended."""

    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]  page * page_size + offset
    page_table: jax.Array  # i32[S, P]  padded with the null page 0
    kv_lens: jax.Array  # i32[S]  tokens in the cache after this step
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[]
    logits_indices: jax.Array  # i32[L]  each sequence's last fed token, then draft positions (L = S, or T: see


# A pytree's host arrays packed as one buffer (`pack_host_inputs`): the tree's structure and, per leaf, where it lies in
# the buffer (offset, shape, dtype character) or None for a leaf passed as it is. Static: part of a program's signature.
HostLayout = tuple[jax.tree_util.PyTreeDef, tuple[tuple[int, tuple[int, ...], str] | None, ...]]


def pack_host_inputs(tree, like: HostLayout | None = None) -> tuple[HostLayout, np.ndarray, list]:
    """(layout, buffer i32[N], the other leaves): every numpy leaf of `tree` with a 4-byte dtype (the step's and
    the sampler's host arrays) copied into one int32 buffer, bit for bit, so that a program call makes one
    host-to-device transfer instead of one per array (on a GPU each is a copy of its own; on CPU a step's 19 cost
    the call ~30 us, the packing ~10); device arrays and other leaves are passed as they are.
    `unpack_host_inputs` (traced) rebuilds the tree.

    like: a compiled program's layout: only the leaves it packed are packed (a field that is sometimes a host array,
    sometimes a device one, e.g. penalty counts, is then passed as it is either way, as the program takes it); the
    layout returned differs from it only where such a leaf is not a host array."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    wanted = None  # per leaf: packed by `like` (an entry) or not (None); None: every host array is packed
    if like is not None:  # (a tree of another structure than like's packs nothing: its layout differs anyway)
        wanted = like[1] if like[0] == treedef else (None,) * len(leaves)
    spec, parts, others, offset = [], [], [], 0
    for i, leaf in enumerate(leaves):
        if (wanted is None or wanted[i] is not None) and isinstance(leaf, (np.ndarray, np.generic)) and \
                leaf.itemsize == 4:
            flat = leaf.reshape(-1).view(np.int32)  # (a numpy scalar reshapes too)
            spec.append((offset, leaf.shape, leaf.dtype.char))  # (dtype.name costs ~1.4 us a read)
            parts.append(flat)
            offset += flat.size
        else:
            spec.append(None)
            others.append(leaf)
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return (treedef, tuple(spec)), buffer, others


def unpack_host_inputs(layout: HostLayout, buffer: jax.Array, others: Sequence) -> object:
    """The tree `pack_host_inputs` packed, inside a program: each packed leaf a static slice of `buffer`, its bits
    read as its dtype."""
    treedef, spec = layout
    rest, leaves = iter(others), []
    for entry in spec:
        if entry is None:
            leaves.append(next(rest))
            continue
        offset, shape, dtype = entry
        part = jax.lax.slice(buffer, (offset,), (offset + int(np.prod(shape, dtype=np.int64)),))
        if dtype != "i":  # int32's character
            part = jax.lax.bitcast_convert_type(part, np.dtype(dtype))
        leaves.append(part.reshape(shape))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def has_random_rows(batch: SamplingBatch) -> bool:
    """Whether some row of a host batch samples at random (the fused step's static choice of program)."""
    return bool(np.any(np.asarray(batch.temperature) >= sampler.GREEDY_TEMPERATURE_EPS))


@functools.partial(jax.jit, static_argnums=(1,))
def pad_sampled_tokens(token_ids: jax.Array, size: int) -> jax.Array:
    """i32[size]: token_ids i32[S] (S <= size) followed by zeros (a fused step's previous_tokens)."""
    return jnp.zeros((size,), jnp.int32).at[:token_ids.shape[0]].set(token_ids)


def allocate_kv_pool(config: LlamaConfig, num_pages: int, page_size: int, dtype,
                     mesh: Mesh | None = None, scales: tuple[np.ndarray, np.ndarray] | None = None) -> KVPool:
    """Zeroed pool; with a mesh, sharded on K (each device allocates only its heads). scales: an fp8 pool's
    (k_scale, v_scale) f32 [L, K] (jaxpaged/worker/kv_scales.py), placed beside it."""
    shape = (config.num_hidden_layers, config.num_key_value_heads, num_pages, page_size, config.head_dim)
    if np.dtype(dtype) == np.dtype(kv_quant.FP8_DTYPE):  # e4m3 pages are held as their bytes (kv_quant.py)
        dtype = kv_quant.POOL_DTYPE
    if mesh is None:
        k_scale, v_scale = (None, None) if scales is None else (jnp.asarray(s, jnp.float32) for s in scales)
        return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), k_scale, v_scale)
    if scales is not None:
        raise ValueError("an fp8 KV cache is not supported with tensor parallelism yet")
    sharding = parallel.kv_pool_sharding(mesh)
    return KVPool(parallel.zeros_sharded(shape, dtype, sharding), parallel.zeros_sharded(shape, dtype, sharding))


def kv_bytes_per_page(config: LlamaConfig, page_size: int, dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * page_size * config.head_dim * \
        np.dtype(dtype).itemsize


def empty_step(t: int, s: int, p: int, num_logits: int | None = None) -> StepInput:
    """An all-padding step of shape (T, S, P) with L = num_logits logits rows (default S): warm-up, and the
    receive buffer of followers."""
    return StepInput(np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32),
                     np.zeros((s, p), np.int32), np.zeros(s, np.int32), np.zeros(s + 1, np.int32),
                     np.int32(0), np.zeros(s if num_logits is None else num_logits, np.int32))


# The runner's test hook (`fault_injector(entries, logits) -> logits`) and a step's grammar bitmask, or a
# callable filling it (ModelRunner.execute_model).
FaultInjector = Callable[[Sequence[ScheduledRequest], jax.Array], jax.Array]
GrammarBitmask = np.ndarray | Callable[[], np.ndarray | None]  # see ModelRunner.execute_model
