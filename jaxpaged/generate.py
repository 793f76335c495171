"""Greedy generation with the plain (non-paged) forward: the engine's oracle, and a CLI.

Recomputes the whole sequence each step (no KV cache) at a few padded
lengths, so it is slow but obviously right; the paged engine must match it
token for token.

    python -m jaxpaged.generate --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
    from jaxpaged.models.loader import DEFAULT_MODEL, load_model

    parser = argparse.ArgumentParser(description="Greedy generation with jaxpaged's plain forward.")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, GGUF file, HF folder or repo id")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype)
    tok = loaded.tokenizer
    if args.raw or not tok.chat_template:
        ids = tok(args.prompt)["input_ids"]
    else:
        ids = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    out = greedy_generate(loaded.config, loaded.params, ids, args.max_tokens,
                          loaded.generation_config.eos_token_ids)
    print(tok.decode(out, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
