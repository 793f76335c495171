"""Pallas kernels for jaxpaged: ragged paged attention and KV-pool writes."""

from pallas_kernels.kv_write import write_kv, write_kv_inner
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.tiling import KernelConfig, choose_config
from pallas_kernels.tiling import plan_kernel_calls
from pallas_kernels.triton_attention import ragged_paged_attention_pallas
from pallas_kernels.xla_attention import ragged_paged_attention_xla

__all__ = [
    "KernelConfig",
    "choose_config",
    "plan_kernel_calls",
    "ragged_paged_attention",
    "ragged_paged_attention_pallas",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "write_kv",
    "write_kv_inner",
]
