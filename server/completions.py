"""POST /v1/completions: OpenAI's legacy text completions (plus vLLM's sampling extras)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxpaged.outputs import CompletionOutput, RequestOutput
from server.choices import ChoiceStream, completion_logprobs
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
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which are not supported yet", "echo")
    check_stream_options(body)


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request):
    model = ctx.model_name(body.model)
    _validate(body, ctx)
    prompts = _prompts(body.prompt)
    spec, param = structured_outputs_of(body)
    params = build_sampling_params(body, ctx.defaults, max_tokens=body.max_tokens, logprobs=body.logprobs,
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
    return {**head, "choices": choices, "usage": usage(outputs), "system_fingerprint": None}


def _prompt_text(ctx: ServingContext, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else ctx.tokenizer.decode(out.prompt_token_ids)


def _choice(ctx: ServingContext, body: CompletionRequest, index: int, out: RequestOutput,
            comp: CompletionOutput) -> dict:
    prefix = _prompt_text(ctx, out) if body.echo else ""
    logprobs = None
    if comp.logprobs is not None:
        logprobs = completion_logprobs(comp.token_ids, comp.logprobs, len(prefix))
    return {"index": index, "text": prefix + comp.text,
            "logprobs": logprobs, "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}


async def _chunks(ctx: ServingContext, body: CompletionRequest, submitted: Submitted,
                  head: dict) -> AsyncIterator[dict]:
    states: dict[int, ChoiceStream] = {}
    finals: list[RequestOutput] = []
    async for i, out in submitted.outputs():
        for comp in out.outputs:
            index = i * body.n + comp.index
            fresh = index not in states
            state = states.setdefault(index, ChoiceStream())
            offset = state.sent_chars
            delta = state.take(comp)
            prefix = _prompt_text(ctx, out) if body.echo and fresh else ""
            if delta is None and not prefix:
                continue
            text = prefix + (delta.text if delta else "")
            logprobs = None
            if delta is not None and delta.logprobs is not None:
                logprobs = completion_logprobs(delta.token_ids, delta.logprobs, offset)
            yield {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": delta.finish_reason if delta else None,
                                        "stop_reason": delta.stop_reason if delta else None}]}
        if out.finished:
            finals.append(out)
    if stream_usage_requested(body):
        yield {**head, "choices": [], "usage": usage(finals)}
