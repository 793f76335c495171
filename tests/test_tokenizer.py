"""Tokenizers from GGUF and HF folders agree with transformers; generation config stop ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxpaged.tokenizer import load_generation_config, load_hf_tokenizer

TEXTS = ["Hello world!", "  leading and   inner spaces\n\n\ttabs", "ünïcödé 你好 🙂 café", "1234567 3.14159",
         "<|im_start|>user\nhi<|im_end|>", "don't we'll I'M", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2, hf_gguf_tokenizer, text):
    ours, theirs = smollm2.tokenizer, hf_gguf_tokenizer
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    ids = theirs(text)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_is_byte_identical(smollm2, hf_gguf_tokenizer, messages, add_generation_prompt):
    kwargs = dict(add_generation_prompt=add_generation_prompt, tokenize=False)
    ours = smollm2.tokenizer.apply_chat_template(messages, **kwargs)
    assert ours == hf_gguf_tokenizer.apply_chat_template(messages, **kwargs)
    assert ours.startswith("<|im_start|>")


def test_special_tokens_from_gguf(smollm2):
    tok = smollm2.tokenizer
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok("<|im_end|>")["input_ids"] == [2]


def test_hf_folder_tokenizer_matches_autotokenizer(tiny_checkpoints):
    from transformers import AutoTokenizer
    folder = tiny_checkpoints["mha"]
    ours, theirs = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


def test_chat_template_override(tiny_checkpoints):
    tok = load_hf_tokenizer(tiny_checkpoints["mha"], chat_template="{{ messages[0]['content'] }}!")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"


def test_generation_config_eos_list_is_honoured(tmp_path):
    # Llama-3-Instruct: eos_token is <|end_of_text|> (128001) but turns end with <|eot_id|> (128009).
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "temperature": 0.6, "top_p": 0.9}))
    gen = load_generation_config(tmp_path, config_eos=(128001,))
    assert gen.eos_token_ids == (128001, 128009)
    assert dict(gen.defaults) == {"temperature": 0.6, "top_p": 0.9}
    assert load_generation_config(tmp_path / "nowhere", config_eos=(7,)).eos_token_ids == (7,)


def test_generation_config_int_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_generation_config(tmp_path, config_eos=(2,)).eos_token_ids == (2,)


def test_bad_generation_config_is_a_clear_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: invalid JSON"):
        load_generation_config(tmp_path)


def test_serving_path_never_imports_torch():
    code = ("import sys\n"
            "from jaxpaged import LLM, SamplingParams\n"
            "llm = LLM('smollm2-135m-instruct', max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)\n"
            "out = llm.generate(['Hi'], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)\n"
            "assert len(out[0].outputs[0].token_ids) == 2\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
