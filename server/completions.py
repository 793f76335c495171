"""POST /v1/completions: OpenAI's legacy text completions (plus vLLM's sampling extras)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxpaged.outputs import CompletionOutput, RequestOutput
from server.choices import (ChoiceStream, Delta, completion_logprobs, echo_logprobs, join_logprobs,
                            prompt_logprobs_json)
from server.context import ServingContext
from server.errors import bad_request
from server.params import (build_sampling_params, check_stream_options, stream_usage_requested,
                           structured_outputs_of)
from server.protocol import CompletionRequest
from server.serving import Submitted, check_finished_ok, sse_stream, until_disconnect, usage


def _prompts(prompt: str | list) -> list[Any]:
    """The request's prompt(s) in the engine's forms: text, or {"prompt_token_ids": [...]}."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise bad_request("token-id prompts must not be empty", "prompt")
        return [{"prompt_token_ids": p} for p in prompt]
    return list(prompt)


def _validate(body: CompletionRequest, ctx: ServingContext) -> None:
    if body.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} is not supported; only best_of == n", "best_of")
    cap = ctx.config.max_completion_logprobs
    if body.logprobs is not None and body.logprobs > cap:
        raise bad_request(f"logprobs={body.logprobs}: at most {cap} for completions", "logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens=0 needs echo=true (it returns the prompt alone)", "max_tokens")
    check_stream_options(body)


def _prompt_logprobs_k(body: CompletionRequest) -> int | None:
    """The engine's prompt_logprobs: echo with logprobs needs the prompt's own (as many top entries)."""
    if body.echo and body.logprobs is not None:
        return max(body.logprobs, body.prompt_logprobs or 0)
    return body.prompt_logprobs


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request):
    model = ctx.model_name(body.model)
    _validate(body, ctx)
    prompts = _prompts(body.prompt)
    spec, param = structured_outputs_of(body)
    # max_tokens=0 (echo only): one token is generated and dropped (_generated), the prompt alone comes back
    params = build_sampling_params(body, ctx.defaults, max_tokens=1 if body.max_tokens == 0 else body.max_tokens,
                                   logprobs=body.logprobs, prompt_logprobs=_prompt_logprobs_k(body),
                                   structured_outputs=spec)
    await ctx.compile_constraint(spec, param)
    response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    submitted = ctx.submitted()
    for i, prompt in enumerate(prompts):
        await submitted.add(f"{response_id}-{i}", prompt, params, "prompt")
    head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
    if body.stream:
        chunks = _chunks(ctx, body, submitted, head)
        return StreamingResponse(sse_stream(chunks, submitted), media_type="text/event-stream")
    outputs = await until_disconnect(request, submitted.final_outputs(), submitted.abort)
    check_finished_ok(outputs)
    choices = [_choice(ctx, body, i * body.n + comp.index, out, comp)
               for i, out in enumerate(outputs) for comp in out.outputs]
    return {**head, "choices": choices, "usage": _usage(body, outputs), "system_fingerprint": None}


def _usage(body: CompletionRequest, outputs: list[RequestOutput]) -> dict[str, int]:
    counts = usage(outputs)
    if body.max_tokens == 0:  # the dropped token is not the client's
        counts = {**counts, "completion_tokens": 0, "total_tokens": counts["prompt_tokens"]}
    return counts


def _generated(body: CompletionRequest, comp: CompletionOutput | Delta) -> tuple[str, list[int], list | None]:
    """The choice's generated text, token ids and logprob entries; none for max_tokens=0."""
    if body.max_tokens == 0:
        return "", [], None if comp.logprobs is None else []
    return comp.text, comp.token_ids, comp.logprobs


def _finish(body: CompletionRequest, finish_reason: str | None, stop_reason) -> dict:
    if body.max_tokens == 0 and finish_reason is not None:  # whatever ended the dropped token
        return {"finish_reason": "length", "stop_reason": None}
    return {"finish_reason": finish_reason, "stop_reason": stop_reason}


def _echo_logprobs(ctx: ServingContext, out: RequestOutput, prompt_logprobs: list | None = None) -> dict:
    ids = out.prompt_token_ids
    return echo_logprobs(prompt_logprobs or out.prompt_logprobs, ids, ctx.tokenizer.decode(ids[:1]))


def _prompt_text(ctx: ServingContext, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else ctx.tokenizer.decode(out.prompt_token_ids)


def _choice(ctx: ServingContext, body: CompletionRequest, index: int, out: RequestOutput,
            comp: CompletionOutput) -> dict:
    prefix = _prompt_text(ctx, out) if body.echo else ""
    text, token_ids, entries = _generated(body, comp)
    logprobs = None
    if entries is not None:
        logprobs = completion_logprobs(token_ids, entries, len(prefix))
        if body.echo:
            logprobs = join_logprobs(_echo_logprobs(ctx, out), logprobs, 0)
    choice = {"index": index, "text": prefix + text, "logprobs": logprobs,
              **_finish(body, comp.finish_reason, comp.stop_reason)}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return choice


async def _chunks(ctx: ServingContext, body: CompletionRequest, submitted: Submitted,
                  head: dict) -> AsyncIterator[dict]:
    states: dict[int, ChoiceStream] = {}
    finals: list[RequestOutput] = []
    prompt_lps: dict[int, list] = {}  # per prompt: its prompt logprobs, in its first (DELTA) output only
    async for i, out in submitted.outputs():
        if out.prompt_logprobs is not None:
            prompt_lps.setdefault(i, out.prompt_logprobs)
        for comp in out.outputs:
            index = i * body.n + comp.index
            fresh = index not in states
            state = states.setdefault(index, ChoiceStream())
            offset = state.sent_chars
            delta = state.take(comp)
            prefix = _prompt_text(ctx, out) if body.echo and fresh else ""
            if delta is None and not prefix:
                continue
            text, token_ids, entries = _generated(body, delta) if delta else ("", [], None)
            logprobs = None
            if entries is not None:
                logprobs = completion_logprobs(token_ids, entries, offset + len(prefix))
            if prefix and body.logprobs is not None:  # the prompt's logprobs go out with the prompt
                logprobs = join_logprobs(_echo_logprobs(ctx, out, prompt_lps[i]),
                                         logprobs or completion_logprobs([], [], 0), 0)
            state.sent_chars += len(prefix)  # later text offsets count the echoed prompt
            choice = {"index": index, "text": prefix + text, "logprobs": logprobs,
                      **_finish(body, delta.finish_reason if delta else None, delta and delta.stop_reason)}
            if fresh and body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps.get(i))
            yield {**head, "choices": [choice]}
        if out.finished:
            finals.append(out)
    if stream_usage_requested(body):
        yield {**head, "choices": [], "usage": _usage(body, finals)}
