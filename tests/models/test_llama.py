"""Parity of the JAX Llama with transformers' PyTorch LlamaForCausalLM, and config validation."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.llama import Llama, LlamaConfig, UnsupportedModelError, forward_jit
from jaxpaged.models.params import unstack_layers
from jaxpaged.models.loader import load_model
from tests.conftest import TINY_VARIANTS


def _hf_logits(folder, token_ids):
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_transformers(tiny_checkpoints, variant):
    folder = tiny_checkpoints[variant]
    loaded = load_model(str(folder), dtype="float32")
    token_ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=40).tolist()
    ours = np.asarray(forward_jit(loaded.config, loaded.params, jnp.asarray([token_ids]))[0])
    theirs = _hf_logits(folder, token_ids)
    assert ours.shape == theirs.shape == (40, loaded.config.vocab_size)
    assert np.abs(ours - theirs).max() <= 1e-4


def test_config_reads_variant_fields(tiny_checkpoints):
    head_dim = load_model(str(tiny_checkpoints["head_dim"])).config
    assert head_dim.head_dim == 32 and head_dim.hidden_size // head_dim.num_attention_heads == 16
    rope = load_model(str(tiny_checkpoints["llama3_rope"])).config
    assert rope.rope_scaling is not None and rope.rope_scaling.factor == 8.0
    assert rope.rope_theta == 500000.0
    assert load_model(str(tiny_checkpoints["tied"])).config.tie_word_embeddings


def test_nnx_module_matches_pure_forward(tiny_checkpoints):
    loaded = load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")
    model = Llama.from_params(loaded.config, loaded.params)
    tokens = jnp.arange(12) % loaded.config.vocab_size
    single = model(tokens)
    batched = model(jnp.stack([tokens, tokens[::-1]]))
    np.testing.assert_allclose(np.asarray(single), np.asarray(batched[0]), atol=1e-5)
    assert batched.shape == (2, 12, loaded.config.vocab_size)
    with pytest.raises(ValueError, match="token_ids must be"):
        model(jnp.zeros((1, 2, 3), jnp.int32))


def test_forward_takes_per_layer_weights(tiny_checkpoints):
    """The plain forward loops over a per-layer list (the engine's layout) to the scanned stack's logits."""
    loaded = load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")
    tokens = (jnp.arange(24) % loaded.config.vocab_size)[None]
    per_layer = unstack_layers(loaded.params)
    assert isinstance(per_layer["layers"], list)
    np.testing.assert_allclose(np.asarray(forward_jit(loaded.config, per_layer, tokens)),
                               np.asarray(forward_jit(loaded.config, loaded.params, tokens)), atol=1e-6)


def _hf_dict(**overrides):
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return {**base, **overrides}


@pytest.mark.parametrize("overrides, field", [
    (dict(architectures=["GPT2LMHeadModel"]), "supports LlamaForCausalLM, MistralForCausalLM"),
    (dict(architectures=[], model_type="bert"), "model_type='bert'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=4096), "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(UnsupportedModelError, match=field):
        LlamaConfig.from_hf_dict(_hf_dict(**overrides))


def test_eos_token_id_list_and_defaults():
    config = LlamaConfig.from_hf_dict(_hf_dict(eos_token_id=[128001, 128009]))
    assert config.eos_token_ids == (128001, 128009)
    assert config.num_key_value_heads == 2 and config.head_dim == 8


def test_non_llama_checkpoint_folder_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(model_type="gpt2", architectures=["GPT2LMHeadModel"])))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*Qwen3ForCausalLM, Gemma3ForCausalLM"):
        load_model(str(tmp_path))
