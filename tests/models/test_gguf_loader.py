"""GGUF loading: synthetic llama.cpp files of every supported type, and the real SmolLM2."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import gguf_loader
from jaxpaged.models.llama import UnsupportedModelError, forward_jit
from jaxpaged.models.loader import load_model
from jaxpaged.models.weights import WeightLoadError
from tests.conftest import make_tiny_gguf
from tests.greedy_oracle import greedy_generate

SMOL_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "In 1492, Columbus sailed"]


def _hf_gguf_logits(path, token_ids):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_tiny_gguf_logits_match_transformers(tmp_path, tiny_checkpoints, qtype):
    path = make_tiny_gguf(tiny_checkpoints["gqa4"], tmp_path / f"tiny-{qtype}.gguf", qtype)
    loaded = load_model(str(path), dtype="float32")
    token_ids = np.random.default_rng(0).integers(0, 256, size=40).tolist()
    ours = np.asarray(forward_jit(loaded.config, loaded.params, jnp.asarray([token_ids]))[0])
    np.testing.assert_allclose(ours, _hf_gguf_logits(path, token_ids), atol=1e-4, rtol=0)
    if qtype == "F32":  # lossless: the same logits as the safetensors checkpoint it came from
        source = load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")
        ref = forward_jit(source.config, source.params, jnp.asarray([token_ids]))[0]
        np.testing.assert_allclose(ours, np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_tensors_dequantise_to_gguf_reference(qtype):
    """K-quants (which gguf cannot write) are read through gguf's dequantiser with the right shape."""
    import gguf
    from gguf.quants import dequantize

    kind = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 2 * nbytes), dtype=np.uint8)
    raw[:, 1::2] &= 0x3B  # keep any half-float scales finite (high bytes below the inf/NaN exponent)

    class FakeTensor:
        name, tensor_type, data, shape = "t", kind, raw, np.array([2 * block, 3])

    got = gguf_loader._tensor(FakeTensor)
    assert got.shape == (3, 2 * block) and got.dtype == np.float32
    np.testing.assert_array_equal(got, dequantize(raw, kind).reshape(3, 2 * block))


def test_gguf_of_another_architecture_is_rejected(tmp_path, tiny_checkpoints):
    path = make_tiny_gguf(tiny_checkpoints["mha"], tmp_path / "gpt2.gguf", "F32", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="general.architecture='gpt2'"):
        load_model(str(path))


def test_garbage_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(WeightLoadError, match="not a readable GGUF file"):
        load_model(str(path))


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model, tokenizer


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and c.vocab_size == 49152
    assert smollm2.generation_config.eos_token_ids == (2,)


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    import torch
    model, _ = hf_smollm2
    for prompt in SMOL_PROMPTS:
        ids = smollm2.tokenizer(prompt)["input_ids"]
        ours = np.asarray(forward_jit(smollm2.config, smollm2.params, jnp.asarray([ids]))[0])
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ours - theirs).max() <= 1e-3, prompt


def test_smollm2_greedy_continuations_match_transformers(smollm2, hf_smollm2):
    import torch
    model, _ = hf_smollm2
    for prompt in SMOL_PROMPTS:
        ids = smollm2.tokenizer(prompt)["input_ids"]
        ours = greedy_generate(smollm2.config, smollm2.params, ids, 32)
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert ours == theirs[0, len(ids):].tolist(), prompt


def test_smollm2_answers_paris(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    out = greedy_generate(smollm2.config, smollm2.params, list(ids), 32, smollm2.generation_config.eos_token_ids)
    assert "Paris" in smollm2.tokenizer.decode(out, skip_special_tokens=True)
