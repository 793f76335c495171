"""Pallas kernels for jaxpaged: ragged paged attention and KV-pool writes."""

from pallas_kernels.kv_write import write_kv, write_kv_inner
from pallas_kernels.ragged_paged_attention import (
    KernelConfig,
    choose_config,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)

__all__ = [
    "KernelConfig",
    "choose_config",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "write_kv",
    "write_kv_inner",
]
