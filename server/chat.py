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
from server.params import (build_sampling_params, check_stream_options, stream_usage_requested,
                           structured_outputs_of)
from server.protocol import ChatCompletionRequest, ChatMessage
from server.serving import Submitted, check_finished_ok, sse_stream, until_disconnect, usage
from server.tools import (ToolPlan, arguments_delta, call_deltas, call_head_delta, history_fields,
                          looks_like_call, message_calls, parse_calls, plan_tools)

def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (roles and part types are the body model's checks);
    400 for none (a Responses request can give no input and no instructions)."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    turns = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        turns.append({"role": message.role, "content": content or "", **history_fields(i, message)})
    return turns


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: tuple[dict, ...] = ()) -> dict:
    """The engine prompt: the template's text and its token ids (the template wrote any BOS itself)."""
    try:
        text = ctx.tokenizer.apply_chat_template(conversation(messages), tools=list(tools) or None,
                                                 tokenize=False, add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, ValueError) as err:
        raise bad_request(f"cannot apply the chat template: {err}", "messages") from None
    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt": text, "prompt_token_ids": list(ids)}


def _validate(body: ChatCompletionRequest, ctx: ServingContext) -> None:
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
    plan = plan_tools(body, ctx.config.auto_tool_choice)
    spec, param = structured_outputs_of(body)
    if spec is not None and plan.constraint is not None:
        raise bad_request(f"{param} cannot be combined with tool_choice {plan.mode!r} (it constrains the "
                          "output to the tool call)", param)
    if plan.constraint is not None:
        spec, param = plan.constraint, "tool_choice"
    prompt = render_chat(ctx, body.messages, body.add_generation_prompt, plan.tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_sampling_params(body, ctx.defaults, max_tokens=max_tokens,
                                   logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                   structured_outputs=spec)
    await ctx.compile_constraint(spec, param)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    submitted = ctx.submitted()
    await submitted.add(response_id, prompt, params, "messages")
    head = {"id": response_id, "object": "chat.completion", "created": created, "model": model}
    if body.stream:
        chunks = _chunks(body, plan, submitted, {**head, "object": "chat.completion.chunk"})
        return StreamingResponse(sse_stream(chunks, submitted), media_type="text/event-stream")
    (out,) = await until_disconnect(request, submitted.final_outputs(), submitted.abort)
    check_finished_ok([out])
    choices = [_choice(body, plan, comp) for comp in out.outputs]
    extra = {} if body.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
    return {**head, "choices": choices, "usage": usage([out]), "system_fingerprint": None, **extra}


def _choice(body: ChatCompletionRequest, plan: ToolPlan, comp: CompletionOutput) -> dict:
    logprobs = None
    if comp.logprobs is not None:
        logprobs = chat_logprobs(comp.token_ids, comp.logprobs, body.top_logprobs or 0)
    text = comp.text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = comp.finish_reason
    if plan.calls_tools:
        content, calls = parse_calls(plan, text)
        message = {"role": "assistant", "content": content, "tool_calls": message_calls(calls)}
        finish_reason = _tool_finish_reason(comp.finish_reason, calls)
    return {"index": comp.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": comp.stop_reason}


def _tool_finish_reason(finish_reason: str | None, calls: list) -> str | None:
    """"tool_calls" when the output ended in complete calls; "length" (cut short) stays."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _chunk(head: dict, index: int, delta: dict, logprobs: Any = None, finish_reason: str | None = None,
           stop_reason: Any = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**head, "system_fingerprint": None, "choices": [choice]}


async def _chunks(body: ChatCompletionRequest, plan: ToolPlan, submitted: Submitted,
                  head: dict) -> AsyncIterator[dict]:
    for index in range(body.n):
        yield _chunk(head, index, {"role": "assistant", "content": None if plan.forced else ""})
    states = [ChoiceStream() for _ in range(body.n)]
    tool_states = [_ToolStream(plan) for _ in range(body.n)]
    final: RequestOutput | None = None
    async for _, out in submitted.outputs():
        for comp in out.outputs:
            delta = states[comp.index].take(comp)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs = chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
            if plan.calls_tools:
                for chunk in tool_states[comp.index].chunks(head, comp.index, delta, logprobs):
                    yield chunk
                continue
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            yield _chunk(head, comp.index, content, logprobs, delta.finish_reason, delta.stop_reason)
        final = out if out.finished else final
    if stream_usage_requested(body) and final is not None:
        yield {**head, "system_fingerprint": None, "choices": [], "usage": usage([final])}


class _ToolStream:
    """One choice's streamed tool calls.

    named: the generated text is the arguments: a head delta, then each text delta as a fragment.
    required: the JSON array is held until it is complete, then sent as calls.
    auto: held while the output may still be a call (starts with "{" or <|python_tag|>); plain text streams as
    content once it clearly is not one.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.held_logprobs: list | None = None
        self.is_call: bool | None = True if plan.forced else None
        self.head_sent = False

    def chunks(self, head: dict, index: int, delta, logprobs) -> list[dict]:
        self.text += delta.text
        if self.plan.mode == "named":
            return self._named(head, index, delta, logprobs)
        if self.is_call is None:
            self.is_call = looks_like_call(self.text)
        if self.is_call is False:  # auto, plain content: stream what was held and what comes
            text, self.text = self.text, ""
            content = {"content": text} if text or not delta.finish_reason else {}
            return [_chunk(head, index, content, self._take_logprobs(logprobs), delta.finish_reason,
                           delta.stop_reason)]
        self._hold_logprobs(logprobs)
        if not delta.finish_reason:
            return []
        content, calls = parse_calls(self.plan, self.text)
        out = [_chunk(head, index, {"content": content})] if content else []
        out += [_chunk(head, index, d) for d in call_deltas(0, calls)]
        out.append(_chunk(head, index, {}, self._take_logprobs(None),
                          _tool_finish_reason(delta.finish_reason, calls), delta.stop_reason))
        return out

    def _named(self, head: dict, index: int, delta, logprobs) -> list[dict]:
        out = []
        if not self.head_sent:
            out.append(_chunk(head, index, call_head_delta(0, self.plan.name)))
            self.head_sent = True
        if delta.text:
            out.append(_chunk(head, index, arguments_delta(0, delta.text), logprobs))
            logprobs = None
        if delta.finish_reason:
            out.append(_chunk(head, index, {}, logprobs, _tool_finish_reason(delta.finish_reason, [self.plan.name]),
                              delta.stop_reason))
        return out

    def _hold_logprobs(self, logprobs) -> None:
        if logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + logprobs["content"]

    def _take_logprobs(self, logprobs):
        self._hold_logprobs(logprobs)
        held, self.held_logprobs = self.held_logprobs, None
        return None if held is None else {"content": held}
