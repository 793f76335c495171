"""Tokenizers and generation defaults, from a Hugging Face folder or a GGUF file.

A folder's tokenizer comes through transformers (fast tokenizer, chat template
via `apply_chat_template`). A GGUF file's is built with `tokenizers` from the
file's own vocabulary, merges, special tokens and chat template, then wrapped
in transformers' `PreTrainedTokenizerFast`, so both paths offer the same API.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' import-time "PyTorch was not found" advice: jaxpaged uses only its
    tokenizers, never its models, and serving never installs or imports torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


# On transformers' own logger, before its first import (the advice is logged while it is imported).
if not any(isinstance(f, _NoTorchAdvice) for f in logging.getLogger("transformers").filters):
    logging.getLogger("transformers").addFilter(_NoTorchAdvice())

# pylint: disable=wrong-import-position
from transformers import (PreTrainedTokenizerBase,  # noqa: E402, F401  (after the filter; loader imports it here)
                          PreTrainedTokenizerFast)  # not AutoTokenizer: importing it imports torch

if TYPE_CHECKING:  # the gguf package is needed only to read GGUF files
    from jaxpaged.models.gguf_file import GGUFFile

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`; unlisted byte-level files use GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/2.5/3: as Llama 3's, but digits one at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                         "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_SPIECE_SPACE = "\u2581"  # SentencePiece's visible space


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What the checkpoint says about stopping and default sampling."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    defaults: tuple[tuple[str, Any], ...] = ()  # e.g. (("temperature", 0.6), ("top_p", 0.9))

    def __post_init__(self):
        if any(not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids={self.eos_token_ids!r} must be non-negative ints")


_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def load_generation_config(folder: Path | None, config_eos: tuple[int, ...] = (),
                           path: Path | None = None) -> GenerationConfig:
    """Every id in `eos_token_id` (int or list, generation_config.json over config.json) stops."""
    gen_path = path or (folder / "generation_config.json" if folder is not None else None)
    data: dict[str, Any] = {}
    if gen_path is not None and gen_path.is_file():
        try:
            data = json.loads(gen_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{gen_path}: invalid JSON ({err})") from None
    eos = tuple(dict.fromkeys(_as_ids(data.get("eos_token_id")) + tuple(config_eos)))
    defaults = tuple((k, data[k]) for k in _SAMPLING_DEFAULT_KEYS if data.get(k) is not None)
    return GenerationConfig(eos_token_ids=eos, bos_token_id=data.get("bos_token_id"), defaults=defaults)


def load_hf_tokenizer(source: str | Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer (tokenizer.json) from a local folder."""
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source))
    except Exception as err:
        raise ValueError(f"cannot load a tokenizer from {source}: {err}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_gguf_tokenizer(reader: GGUFFile, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer a GGUF file describes: byte-level BPE ('gpt2': Llama 3, SmolLM2, Qwen) or
    SentencePiece BPE with byte fallback ('llama': Gemma, Llama 2, Mistral)."""
    from jaxpaged.models.gguf_loader import metadata_value  # pylint: disable=import-outside-toplevel
    kind = metadata_value(reader, "tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (supported: {sorted(builders)}); "
                         "pass a Hugging Face tokenizer folder with --tokenizer instead")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    types = metadata_value(reader, "tokenizer.ggml.token_type", [])
    backend, tokens = builders[kind](reader, tokens, metadata_value)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

    def token(key):
        index = metadata_value(reader, f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    if metadata_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        bos_id = tokens.index(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        chat_template=chat_template or metadata_value(reader, "tokenizer.chat_template"))


def _byte_level_bpe(reader, tokens: list[str], metadata_value) -> tuple[Tokenizer, list[str]]:
    merges = [tuple(m.split(" ", 1)) for m in metadata_value(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split = _PRE_TOKENIZER_SPLITS.get(metadata_value(reader, "tokenizer.ggml.pre"))
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if split else pre_tokenizers.ByteLevel(add_prefix_space=False))
    backend.decoder = decoders.ByteLevel()
    return backend, tokens


def _sentencepiece_bpe(reader, tokens: list[str], metadata_value) -> tuple[Tokenizer, list[str]]:
    """SentencePiece BPE: spaces as U+2581, byte fallback (<0x..> tokens), merges rebuilt from the vocab.

    GGUF files list no merges for SentencePiece vocabularies: every token that splits into two
    vocabulary pieces yields a merge, ranked by the token's score (Gemma: by its position, as its
    scores do not follow its merge order). Gemma stores its whitespace-run tokens as real spaces."""
    gemma = metadata_value(reader, "general.architecture", "").startswith("gemma")
    tokens = [_SPIECE_SPACE * len(t) if gemma and t and not t.strip(" ") else t for t in tokens]
    scores = metadata_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    rank = [-i for i in range(len(tokens))] if gemma else scores
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    unk_id = metadata_value(reader, "tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocab(tokens, vocab, rank), fuse_unk=True,
                                   byte_fallback=True, unk_token=tokens[unk_id] if unk_id is not None else None))
    prefix = metadata_value(reader, "tokenizer.ggml.add_space_prefix", not gemma)
    replace = normalizers.Replace(" ", _SPIECE_SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, tokens


def _merges_from_vocab(tokens: list[str], vocab: dict[str, int], rank) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary pieces, best-ranked token first
    (then longer left piece, then longer right piece; splits of one token by piece ids)."""
    found = []
    for token, score in zip(tokens, rank):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in splits)
    found.sort(key=lambda m: m[:3], reverse=True)
    return [(left, right) for *_, left, right in found]
