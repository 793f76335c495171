"""Request bodies -> SamplingParams, with the model's generation_config defaults for unset fields."""

from __future__ import annotations

from typing import Any

from jaxpaged.errors import InvalidRequestError
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from server.errors import bad_request, from_invalid_request
from server.protocol import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingFields

__all__ = ["MAX_LOGIT_BIAS_ENTRIES", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "build_sampling_params",
           "check_stream_options", "stream_usage_requested", "structured_outputs_of"]

_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def build_sampling_params(body: SamplingFields, defaults: dict[str, Any], *, max_tokens: int | None,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams for a request; a value SamplingParams rejects is a 400 naming the field.

    A stream asks the engine for DELTA outputs (only what is new each step), a plain request for
    FINAL_ONLY (one output at the end). prompt_logprobs: the handler's count when it needs more than
    the body's own (completions' echo with logprobs)."""
    chosen = {k: getattr(body, k) if getattr(body, k) is not None else defaults.get(k, _FALLBACK[k])
              for k in _DEFAULTABLE}
    try:
        return SamplingParams(
            n=body.n, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            logit_bias=_logit_bias(body.logit_bias), seed=body.seed, max_tokens=max_tokens,
            min_tokens=body.min_tokens, stop=_stop(body.stop), stop_token_ids=_stop_token_ids(body.stop_token_ids),
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs, **chosen)
    except InvalidRequestError as err:
        raise from_invalid_request(err) from None


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """As a tuple (the body's model has checked each is non-empty and how many there are)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _stop_token_ids(ids: list[int] | None) -> tuple[int, ...]:
    return tuple(ids or ())


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Keys as token ids (the body's model has checked they are digits, the biases and the count)."""
    return {int(k): float(v) for k, v in bias.items()} if bias else None


def stream_usage_requested(body: SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from (for a 400's `param`), or (None, None).

    Sources: OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs extra body
    and its older guided_json / guided_regex / guided_choice / guided_grammar; at most one may be given.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(rf)))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object}
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v not in (None, False)}))
    for name, kind in _GUIDED.items():
        if getattr(body, name) is not None:
            found.append((name, {kind: getattr(body, name)}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {', '.join(p for p, _ in found)}", found[1][0])
    param, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), param
    except ValueError as err:
        raise bad_request(str(err).replace("StructuredOutputsParams", param), param) from None


def _response_format(rf) -> dict[str, Any]:
    """A json_object or json_schema response_format (its type is one of the model's Literal values)."""
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
    return {"json": rf.json_schema.schema_}
