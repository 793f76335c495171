"""Tensor parallelism (Megatron-style, by sharding annotations) and multi-host stepping.

docs/distributed.md gives the design: params and the KV pool on `NamedSharding`s over a 1-D "tp" mesh, XLA
inserting the collectives, attention run per shard under `shard_map`, and process 0 broadcasting each step to
the followers. Beyond its table of the sharding rule (`param_partition_specs`): the fused wqkv [L, E, K, G+2, D]
is sharded on K (each device its kv heads with their query heads), w_gate_up [L, E, 2, F] on F, Qwen2's biases
bq [L, H, D], bk/bv [L, K, D] on their head axis, q/k and sandwich norms replicated; per-layer weights
(WeightLayout.per_layer) take the same specs without the leading L axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.models.llama import LlamaConfig, Params
from jaxpaged.models.params import WeightLayout, param_shapes

TP = "tp"
POOL_SPEC = P(None, TP, None, None, None)  # [L, K, N, page_size, D], sharded on K
HEADS_SPEC = P(None, TP, None)  # q [T, H, D], k/v [T, K, D]
_STOP, _STEP = 0, 1


# ----------------------------------------------------------------------------- validation, mesh


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """ValueError unless `tp` splits the KV heads, query heads and MLP width evenly."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
    c = config
    if c.num_key_value_heads % tp or c.num_attention_heads % tp or c.intermediate_size % tp:
        valid = [d for d in range(1, c.num_key_value_heads + 1)
                 if c.num_key_value_heads % d == 0 and c.num_attention_heads % d == 0 and c.intermediate_size % d == 0]
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_key_value_heads="
                         f"{c.num_key_value_heads} and num_attention_heads={c.num_attention_heads} (and "
                         f"intermediate_size={c.intermediate_size}); valid sizes for this model: {valid}")


def make_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh ("tp",) over the first `tp` of `devices` (default: all global devices)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} devices are visible "
                         f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
                         f"={tp} before JAX starts")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def vocab_sharded(config: LlamaConfig, tp: int) -> bool:
    """Embeddings and LM head are sharded on V when it divides evenly; otherwise replicated."""
    return config.vocab_size % tp == 0


# ----------------------------------------------------------------------------- shardings


def param_partition_specs(config: LlamaConfig, tp: int, layout: WeightLayout = WeightLayout()) -> Params:
    """PartitionSpecs of the params pytree in `layout`, mirroring `param_shapes` (module docstring)."""
    v = TP if vocab_sharded(config, tp) else None
    specs: Params = {
        "embed": P(v, None),
        "layers": {
            "attn_norm": P(), "mlp_norm": P(),
            "wq": P(None, None, TP, None), "wk": P(None, None, TP, None), "wv": P(None, None, TP, None),
            "wo": P(None, TP, None, None),
            "w_gate": P(None, None, TP), "w_up": P(None, None, TP), "w_down": P(None, TP, None),
            "bq": P(None, TP, None), "bk": P(None, TP, None), "bv": P(None, TP, None),  # [L, H|K, D]
            "wqkv": P(None, None, TP, None, None), "w_gate_up": P(None, None, None, TP),
        },
        "final_norm": P(),
    }
    # Only the layer params this family has; the ones not named above (q/k/post norms) are replicated.
    specs["layers"] = {key: specs["layers"].get(key, P()) for key in param_shapes(config, layout.fused)["layers"]}
    if layout.per_layer:
        one = {key: P(*spec[1:]) for key, spec in specs["layers"].items()}
        specs["layers"] = [dict(one) for _ in range(config.num_hidden_layers)]
    if not config.tie_word_embeddings:
        specs["lm_head"] = P(None, v)
    return specs


def param_shardings(config: LlamaConfig, mesh: Mesh, layout: WeightLayout = WeightLayout()) -> Params:
    """NamedShardings of the params pytree in `layout` on `mesh` (validated for its size)."""
    tp = mesh.shape[TP]
    check_tensor_parallel(config, tp)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_partition_specs(config, tp, layout),
                        is_leaf=lambda x: isinstance(x, P))


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """Place a host/device array onto `sharding`; each process supplies only its own shards.

    Works single- and multi-process: every process holds the same full value `x`
    (host copy) and transfers just the slices its devices own.
    """
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: Params, shardings: Params) -> Params:
    """Params placed onto their shardings (a no-op for leaves already there)."""
    return jax.tree.map(put_global, params, shardings)


def zeros_sharded(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
    """Zeros allocated shard by shard on their devices (no full copy anywhere)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


# ----------------------------------------------------------------------------- per-shard attention


def shard_attention(attend: Callable, mesh: Mesh) -> Callable:
    """Run attend(q, k, v, k_pool, v_pool, step, layer, window) -> (o, k_pool, v_pool) per TP shard.

    q/o [T, H, D] and k/v [T, K, D] are split on heads, the pools [L, K, N, ps, D]
    on K; the step input (any pytree), the layer index and its sliding window are replicated. Each
    shard writes and attends its own heads, so no collective is needed inside.
    """
    return jax.shard_map(attend, mesh=mesh, check_vma=False,
                         in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, POOL_SPEC, POOL_SPEC, P(), P(), P()),
                         out_specs=(HEADS_SPEC, POOL_SPEC, POOL_SPEC))


# ----------------------------------------------------------------------------- multi-host


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Arguments of `jax.distributed.initialize` (vLLM has no equivalent flags; these are ours)."""

    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(f"num_processes={self.num_processes} needs distributed_coordinator='host:port'")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1


def initialize_distributed(dist: DistributedConfig) -> None:
    """`jax.distributed.initialize` once, before any JAX computation (CPU: gloo collectives)."""
    if not dist.enabled or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=dist.coordinator_address,
                               num_processes=dist.num_processes, process_id=dist.process_id)


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process reaches the barrier `name` (jax.distributed's coordination service, as
    jax.experimental.array_serialization does): unlike a collective, it waits up to `timeout_s`."""
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    if distributed.global_state.client is not None:
        distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_step(step: Any | None, empty_step: Callable[[int, int, int], Any]) -> Any | None:
    """Process 0 sends `step` (None = stop); others pass None and get it back, or None on stop.

    Two collectives: a fixed-shape header i32[4] = (command, T, S, P), then the
    step's arrays, whose shapes the header gave the receivers (`empty_step(T, S, P)`).
    """
    from jax.experimental import multihost_utils
    if is_leader():
        header = np.zeros(4, np.int32) if step is None else np.asarray(
            [_STEP, step.token_ids.shape[0], *step.page_table.shape], np.int32)
    else:
        header = np.zeros(4, np.int32)
    command, t, s, p = (int(x) for x in multihost_utils.broadcast_one_to_all(header))
    if command == _STOP:
        return None
    template = step if is_leader() else empty_step(t, s, p)
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(template))


__all__ = ["DistributedConfig", "TP", "barrier", "broadcast_step", "check_tensor_parallel", "initialize_distributed",
           "is_leader", "kv_pool_sharding", "make_mesh", "param_partition_specs", "param_shardings",
           "put_global", "replicated", "shard_attention", "shard_params", "vocab_sharded", "zeros_sharded"]
