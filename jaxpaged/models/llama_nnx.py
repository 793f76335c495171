"""`Llama`, the Flax NNX front of jaxpaged/models/llama.py (`from jaxpaged.models.llama import Llama` works too).

Kept apart so that importing the engine does not import Flax.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.llama import LlamaConfig, Params, forward_jit
from jaxpaged.models.params import init_params


class LlamaLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading layer axis."""

    def __init__(self, weights: Mapping[str, jax.Array]):
        for name, weight in weights.items():
            setattr(self, name, nnx.Param(weight))


class Llama(nnx.Module):
    """Llama causal LM. `logits = model(token_ids)` with token_ids [B, T] or [T]."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = config
        params = init_params(config, (rngs or nnx.Rngs(0)).params(), dtype)
        self.embed = nnx.Param(params["embed"])
        self.layers = LlamaLayers(params["layers"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None

    @classmethod
    def from_params(cls, config: LlamaConfig, params: Params) -> Llama:
        """Wrap a loaded params pytree without allocating random weights first."""
        dtype = params["embed"].dtype
        abstract = nnx.eval_shape(lambda: cls(config, dtype=dtype))
        graphdef, state = nnx.split(abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def params(self) -> Params:
        """The pure params pytree the engine and `forward` take."""
        pure = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return {k: v for k, v in pure.items() if v is not None}

    def __call__(self, token_ids) -> jax.Array:
        token_ids = jnp.asarray(token_ids, dtype=jnp.int32)
        if token_ids.ndim not in (1, 2):
            raise ValueError(f"token_ids must be [T] or [B, T], got shape {token_ids.shape}")
        if token_ids.shape[-1] > self.config.max_position_embeddings:
            raise ValueError(f"{token_ids.shape[-1]} tokens exceed max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        batched = token_ids if token_ids.ndim == 2 else token_ids[None]
        logits = forward_jit(self.config, self.params(), batched)
        return logits if token_ids.ndim == 2 else logits[0]
