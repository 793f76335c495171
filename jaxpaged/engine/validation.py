"""Request validation: the engine's one check of a request before it is queued.

`LLMEngine.add_request` calls `validate_request` before anything is queued, so a
request that could never be served (a token id outside the vocabulary, more
biased and banned ids than the sampler has room for, a feature not implemented)
fails alone, at once, instead of failing a whole step for every request in it.
Every check raises `InvalidRequestError` (jaxpaged/errors.py) naming the parameter,
as `SamplingParams` and the scheduler's admission do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxpaged.errors import InvalidRequestError
from jaxpaged.sample.sampling_batch import MAX_BIAS_ENTRIES
from jaxpaged.sampling_params import SamplingParams


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """InvalidRequestError naming `param` if an id is outside [0, vocab_size)."""
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise InvalidRequestError(f"{param}: token ids {outside[:5]} are outside the vocabulary "
                                  f"[0, {vocab_size})", param)


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                     eos_token_ids: Sequence[int] = ()) -> None:
    """Everything about one request the engine can check before queueing it (see the module doc).

    The length checks (prompt + max_tokens against max_model_len and the KV pool) are the
    scheduler's admission, which raises the same error with param "prompt".
    """
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    check_token_ids((t for t, _ in params.logit_bias or ()), vocab_size, "logit_bias")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    # Before min_tokens the sampler bans EOS and stop token ids next to the logit_bias entries.
    banned = 0 if params.min_tokens == 0 else len(params.stop_token_ids) + \
        (0 if params.ignore_eos else len(eos_token_ids))
    num_bias = len(params.logit_bias or ())
    if num_bias + banned > MAX_BIAS_ENTRIES:
        param = "logit_bias" if num_bias > MAX_BIAS_ENTRIES else "stop_token_ids"
        raise InvalidRequestError(f"{num_bias} logit_bias entries + {banned} ids banned before min_tokens "
                                  f"(stop_token_ids, EOS) exceed the sampler's {MAX_BIAS_ENTRIES}", param)


__all__ = ["check_token_ids", "validate_request"]
