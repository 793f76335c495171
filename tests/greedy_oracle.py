"""Greedy generation with the plain (non-paged) forward: the engine's oracle in the tests.

Recomputes the whole sequence each step (no KV cache) at a few padded
lengths, so it is slow but obviously right; the paged engine must match it
token for token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpaged.models.llama import LlamaConfig, Params, forward_jit


def _bucket(n: int, minimum: int = 64) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def greedy_generate(config: LlamaConfig, params: Params, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of one prompt; stops after an EOS id (included) or max_new_tokens."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    tokens = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens and len(tokens) < config.max_position_embeddings:
        length = min(_bucket(len(tokens)), config.max_position_embeddings)
        padded = np.zeros((1, length), np.int32)  # right padding cannot affect earlier positions
        padded[0, : len(tokens)] = tokens
        logits = forward_jit(config, params, jnp.asarray(padded))
        next_id = int(jnp.argmax(logits[0, len(tokens) - 1]))
        tokens.append(next_id)
        out.append(next_id)
        if next_id in eos_token_ids:
            break
    return out

