"""POST /v1/chat/completions: messages through the model's chat template, then generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxpaged.outputs import CompletionOutput, RequestOutput
from server.choices import ChoiceStream, chat_logprobs, prompt_logprobs_json
from server.context import ServingContext
from server.errors import bad_request
from server.params import build_sampling_params, check_stream_options, stream_usage_requested
from server.protocol import ChatCompletionRequest, ChatMessage
from server.serving import Submitted, check_finished_ok, sse_stream, until_disconnect, usage

ROLES = ("system", "developer", "user", "assistant", "tool")


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them; 400 for what we cannot render."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    turns = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role={message.role!r}: must be one of {', '.join(ROLES)}",
                              "messages")
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: content part type {part.type!r} is not supported "
                                      "(only 'text')", "messages")
                parts.append(part.text)
            content = "".join(parts)
        turns.append({"role": message.role, "content": content or ""})
    return turns


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True) -> dict:
    """The engine prompt: the template's text and its token ids (the template wrote any BOS itself)."""
    try:
        text = ctx.tokenizer.apply_chat_template(conversation(messages), tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, ValueError) as err:
        raise bad_request(f"cannot apply the chat template: {err}", "messages") from None
    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt": text, "prompt_token_ids": list(ids)}


def _validate(body: ChatCompletionRequest, ctx: ServingContext) -> None:
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(f"response_format type {body.response_format.type!r} is not supported (only 'text')",
                          "response_format")
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if body.top_logprobs > ctx.config.max_chat_logprobs:
            raise bad_request(f"top_logprobs={body.top_logprobs}: at most {ctx.config.max_chat_logprobs}",
                              "top_logprobs")
    check_stream_options(body)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    model = ctx.model_name(body.model)
    _validate(body, ctx)
    prompt = render_chat(ctx, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_sampling_params(body, ctx.defaults, max_tokens=max_tokens,
                                   logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    submitted = ctx.submitted()
    await submitted.add(response_id, prompt, params, "messages")
    head = {"id": response_id, "object": "chat.completion", "created": created, "model": model}
    if body.stream:
        chunks = _chunks(body, submitted, {**head, "object": "chat.completion.chunk"})
        return StreamingResponse(sse_stream(chunks, submitted), media_type="text/event-stream")
    (out,) = await until_disconnect(request, submitted.final_outputs(), submitted.abort)
    check_finished_ok([out])
    choices = [_choice(body, comp) for comp in out.outputs]
    extra = {} if body.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
    return {**head, "choices": choices, "usage": usage([out]), "system_fingerprint": None, **extra}


def _choice(body: ChatCompletionRequest, comp: CompletionOutput) -> dict:
    logprobs = None
    if comp.logprobs is not None:
        logprobs = chat_logprobs(comp.token_ids, comp.logprobs, body.top_logprobs or 0)
    message = {"role": "assistant", "content": comp.text}
    return {"index": comp.index, "message": message, "logprobs": logprobs, "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason}


def _chunk(head: dict, index: int, delta: dict, logprobs: Any = None, finish_reason: str | None = None,
           stop_reason: Any = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**head, "system_fingerprint": None, "choices": [choice]}


async def _chunks(body: ChatCompletionRequest, submitted: Submitted, head: dict) -> AsyncIterator[dict]:
    for index in range(body.n):
        yield _chunk(head, index, {"role": "assistant", "content": ""})
    states = [ChoiceStream() for _ in range(body.n)]
    final: RequestOutput | None = None
    async for _, out in submitted.outputs():
        for comp in out.outputs:
            delta = states[comp.index].take(comp)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs = chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            yield _chunk(head, comp.index, content, logprobs, delta.finish_reason, delta.stop_reason)
        final = out if out.finished else final
    if stream_usage_requested(body) and final is not None:
        yield {**head, "system_fingerprint": None, "choices": [], "usage": usage([final])}
