"""The built-in Gemma 3 270M (Q4_K_M GGUF from PyPI) against transformers reading the same file."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from jaxpaged.models.llama import forward_jit
from jaxpaged.models.loader import load_model, resolve_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
ROUND_TRIP = ["Hello  world!\n\tÜñî 😀 <b>bold</b> a  b   c", "   leading spaces and trailing   ",
              "def f(x):\n    return x**2  # 平方\n\n\n", "ẞ ǅ \u200b \x7f 1234567890 3.14159 ½ ∑ 𝔘",
              "<start_of_turn>user\nhi<end_of_turn>\n", ""]


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", dtype="float32")


@pytest.fixture(scope="module")
def hf_gemma():
    import torch
    from transformers import AutoModelForCausalLM
    path = resolve_model_path("gemma3-270m")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def test_config_is_gemma3_with_local_and_global_layers(gemma):
    c = gemma.config
    assert (c.architecture, c.vocab_size, c.num_hidden_layers, c.sliding_window) == ("gemma3", 262144, 18, 512)
    assert [i for i, w in enumerate(c.windowed_layers) if not w] == [5, 11, 17]
    assert (c.rope_theta, c.local_rope_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256.0)


def test_logits_match_transformers_gguf(gemma, hf_gemma):
    import torch
    ids = gemma.tokenizer(PROMPTS[0] + " Paris. The capital of Germany is")["input_ids"]
    ours = np.asarray(forward_jit(gemma.config, gemma.params, jnp.asarray([ids]))[0])
    with torch.no_grad():
        theirs = hf_gemma(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-3


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips_bytes(gemma, text):
    tok = gemma.tokenizer
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 2
    assert tok.decode(ids[1:]).encode() == text.encode()


def test_tokenizer_matches_transformers_gguf_tokenizer(gemma):
    from transformers import AutoTokenizer
    path = resolve_model_path("gemma3-270m")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in PROMPTS + ROUND_TRIP:
        assert gemma.tokenizer(text)["input_ids"] == ref(text)["input_ids"], text


@pytest.mark.slow
def test_engine_greedy_32_tokens_equal_transformers(gemma, hf_gemma):
    """Paged engine (mixed-length batch, one global layer in six) vs transformers' generate (slow: about
    4 minutes on a loaded 2-core CPU)."""
    import torch
    from jaxpaged import LLM, SamplingParams
    llm = LLM(model="gemma3-270m", dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_pages=48, warmup=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    hf_gemma.generation_config.eos_token_id = None
    for out in outs:
        with torch.no_grad():
            ref = hf_gemma.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(out.prompt_token_ids):].tolist(), out.prompt
    assert "France" in outs[0].outputs[0].text  # greedy: " the capital of the country of France. It is ..."
