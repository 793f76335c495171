"""The weight dots and norms of batch-invariant mode off the native CPU kernels: on a CUDA GPU the fixed-tile Pallas
GEMM (pallas_kernels/batch_invariant_matmul.py) for every weight dot (the fused projections, wo, the MLP, the LM
head, a tied head's embedding too) and for the norms' row sums; XLA's dots and sums on any other platform.

XLA:GPU's own dots (cuBLAS, its Triton GEMMs) choose their tiles and split-K by the row count, so a row's logits
would change with the batch; the kernel sums each row over K in one order at any row count. Which branch runs is
decided where the step is lowered (`lax.platform_dependent`): a step lowered for "cuda" holds the kernel, whatever
machine traced it (tests lower the GPU step from a CPU), and a CPU or TPU step keeps XLA's ops. What the mode needs
on a GPU (float weights, one device) is checked here too (`check_gpu_batch_invariant`).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxpaged.models.weight_dots import Matmul
from pallas_kernels import batch_invariant_matmul as bim

logger = logging.getLogger(__name__)


def check_gpu_batch_invariant(quantization: str | None, sharded: bool) -> None:
    """Batch-invariant mode on a GPU: the kernel reads float weights on one device, so quantized weights (an FP8
    checkpoint is served as "fp8") and a mesh are refused (ValueError naming what to change); logs what it runs."""
    if quantization is not None:
        raise ValueError(f"batch_invariant=True on a GPU does not take quantization={quantization!r} (an FP8 "
                         "checkpoint is served as fp8): its fixed-tile GEMM reads bfloat16, float16 or float32 "
                         "weights; serve the checkpoint unquantized (quantization=None, dtype='bfloat16')")
    if sharded:
        raise ValueError("batch_invariant=True on a GPU runs on one device (tensor_parallel_size=1, one process): "
                         "its fixed-tile GEMM has no sharding rule")
    logger.info("batch_invariant=True on gpu: the weight dots, the LM head and the norms' sums on the fixed-tile "
                "Pallas GEMM (pallas_kernels/batch_invariant_matmul.py), attention on one tiling for every batch "
                "(docs/rl.md)")


def _dot(x: jax.Array, w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (w [N, K] with transpose_w) -> f32 [M, N]: the kernel where lowered for CUDA."""
    kernel = functools.partial(bim.batch_invariant_matmul, transpose_w=transpose_w, out_dtype=jnp.float32)
    spec = "mk,nk->mn" if transpose_w else "mk,kn->mn"
    xla = functools.partial(jnp.einsum, spec, preferred_element_type=jnp.float32)
    return jax.lax.platform_dependent(x, w, cuda=kernel, default=xla)


def _row_sums(y: jax.Array) -> jax.Array:
    """y [..., E] -> f32 sums over E [..., 1]: the kernel's ones-block product where lowered for CUDA."""
    return jax.lax.platform_dependent(
        y, cuda=bim.row_sums, default=lambda y: jnp.sum(y.astype(jnp.float32), axis=-1, keepdims=True))


def gpu_invariant_matmul() -> Matmul:
    """The `weight_dots.Matmul` of batch-invariant mode on a GPU: every 2-D weight dot, a tied head's [V, E] embedding
    (`fn_t`) and the norms' sums on the kernel. Its products come back in float32 (the head's logits are float32;
    the projections round them to x's dtype once, as XLA's dots round their float32 sums)."""
    return Matmul(_dot, lambda x, w: True, _row_sums, functools.partial(_dot, transpose_w=True))
