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
from jaxpaged.sampling_params import StructuredOutputsParams
from server.chat_output import OutputPlan, StreamReader
from server.choices import ChoiceStream, chat_logprobs, prompt_logprobs_json
from server.context import ServingContext
from server.errors import OpenAIError, bad_request
from server.params import (build_sampling_params, check_stream_options, stream_usage_requested,
                           structured_outputs_of)
from server.protocol import ChatCompletionRequest, ChatMessage
from server.serving import Submitted, check_finished_ok, sse_stream, until_disconnect, usage
from server.tools import ToolPlan, history_fields, plan_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEMPLATE_ARGUMENTS = ("conversation", "tools", "tokenize", "add_generation_prompt", "return_dict",
                       "chat_template")  # set by render_chat itself, not by chat_template_kwargs


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
                tools: tuple[dict, ...] = (), template_kwargs: dict[str, Any] | None = None) -> dict:
    """The engine prompt: the template's text and its token ids (the template wrote any BOS itself).

    `template_kwargs`: the request's chat_template_kwargs, extra variables for the template (e.g.
    Qwen3's enable_thinking)."""
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & set(_TEMPLATE_ARGUMENTS))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    try:
        text = ctx.tokenizer.apply_chat_template(conversation(messages), tools=list(tools) or None,
                                                 tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as err:
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
    plan = plan_tools(body, ctx.tool_parser)
    spec, param = structured_outputs_of(body)
    if spec is not None and plan.constraint is not None:
        raise bad_request(f"{param} cannot be combined with tool_choice {plan.mode!r} (it constrains the "
                          "output to the tool call)", param)
    prompt = render_chat(ctx, body.messages, body.add_generation_prompt, plan.tools, body.chat_template_kwargs)
    output = OutputPlan.create(plan, ctx.config.reasoning_parser, prompt["prompt"])
    if plan.constraint is not None:
        spec, param = plan.constraint, "tool_choice"
    await _compile_tool_schemas(ctx, plan)
    spec = await _compile_constraint(ctx, output, spec, param)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_sampling_params(body, ctx.defaults, max_tokens=max_tokens,
                                   logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                   structured_outputs=spec)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    submitted = ctx.submitted()
    await submitted.add(response_id, prompt, params, "messages")
    head = {"id": response_id, "object": "chat.completion", "created": created, "model": model}
    if body.stream:
        chunks = _chunks(ctx, body, output, submitted, {**head, "object": "chat.completion.chunk"})
        return StreamingResponse(sse_stream(chunks, submitted), media_type="text/event-stream")
    (out,) = await until_disconnect(request, submitted.final_outputs(), submitted.abort)
    check_finished_ok([out])
    choices = [_choice(body, output, comp) for comp in out.outputs]
    extra = {} if body.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
    counted = _usage(ctx, output, out, [(c.token_ids, c.text) for c in out.outputs], params.skip_special_tokens)
    return {**head, "choices": choices, "usage": counted, "system_fingerprint": None, **extra}


async def _compile_tool_schemas(ctx: ServingContext, plan: ToolPlan) -> None:
    """Every tool's parameters schema must compile (a 400 naming the tool), whatever tool_choice uses;
    without structured outputs (no llguidance) there is nothing to compile them with."""
    if ctx.engine.engine.structured_outputs is None:
        return
    for i, tool in enumerate(plan.tools):
        schema = tool["function"].get("parameters")
        if schema:
            try:
                await ctx.compile_constraint(StructuredOutputsParams(json=schema), "tools")
            except OpenAIError as err:
                raise bad_request(f"tools[{i}].function.parameters: {err.message}", "tools") from None


async def _compile_constraint(ctx: ServingContext, output: OutputPlan, spec: StructuredOutputsParams | None,
                              param: str | None) -> StructuredOutputsParams | None:
    """The output constraint as applied (after the reasoning, when a parser reads one), compiled. A regex or
    grammar is compiled on its own first, so that its errors name its own kind and point into its own text;
    then a failure of the combined grammar (one over the size limit only with the reasoning span added) is
    a 400 saying so."""
    own_first = output.reasoning is not None and spec is not None and spec.kind in ("regex", "grammar")
    if own_first:
        await ctx.compile_constraint(spec, param)
    applied = output.constraint(spec)
    try:
        await ctx.compile_constraint(applied, param)
    except OpenAIError as err:
        if not own_first:
            raise
        raise bad_request(f"{param}: the {spec.kind} cannot be applied after the reasoning: {err.message}",
                          param) from None
    return applied


def _usage(ctx: ServingContext, output: OutputPlan, out: RequestOutput, texts: list[tuple[list[int], str]],
           skip_special_tokens: bool) -> dict:
    """usage, with completion_tokens_details.reasoning_tokens when a reasoning parser is on."""
    counts = usage([out])
    if ctx.config.reasoning_parser is None:
        return counts

    def decode(ids: list[int]) -> str:
        return ctx.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    reasoning = sum(output.reasoning_tokens(decode, ids, text) for ids, text in texts)
    return {**counts, "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _choice(body: ChatCompletionRequest, output: OutputPlan, comp: CompletionOutput) -> dict:
    logprobs = None
    if comp.logprobs is not None:
        logprobs = chat_logprobs(comp.token_ids, comp.logprobs, body.top_logprobs or 0)
    message, calls = output.message(comp.text)
    finish_reason = _tool_finish_reason(comp.finish_reason, calls) if output.tools.calls_tools else comp.finish_reason
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


async def _chunks(ctx: ServingContext, body: ChatCompletionRequest, output: OutputPlan, submitted: Submitted,
                  head: dict) -> AsyncIterator[dict]:
    for index in range(body.n):
        yield _chunk(head, index, {"role": "assistant", "content": None if output.tools.forced else ""})
    states = [ChoiceStream() for _ in range(body.n)]
    readers = [_ChoiceChunks(StreamReader(output)) for _ in range(body.n)]
    final: RequestOutput | None = None
    async for _, out in submitted.outputs():
        for comp in out.outputs:
            delta = states[comp.index].take(comp)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs = chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
            for chunk in readers[comp.index].chunks(head, comp.index, delta, logprobs):
                yield chunk
        final = out if out.finished else final
    if stream_usage_requested(body) and final is not None:
        texts = [(r.reader.token_ids, r.reader.text) for r in readers]
        counted = _usage(ctx, output, final, texts, body.skip_special_tokens)
        yield {**head, "system_fingerprint": None, "choices": [], "usage": counted}


class _ChoiceChunks:
    """One streamed choice's chunks: its reader's deltas, with the logprobs of the tokens behind them
    (held while a reader holds text back) and the finish reason on the last one."""

    def __init__(self, reader: StreamReader):
        self.reader = reader
        self.held_logprobs: list | None = None

    def chunks(self, head: dict, index: int, delta, logprobs) -> list[dict]:
        if logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + logprobs["content"]
        pieces = self.reader.feed(delta.text, delta.token_ids, delta.finish_reason is not None)
        out = []
        for piece in pieces:
            out.append(_chunk(head, index, piece, self._take_logprobs()))
        if delta.finish_reason:
            finish_reason = delta.finish_reason
            if self.reader.tools.calls_tools:
                finish_reason = _tool_finish_reason(finish_reason, [None] * self.reader.num_calls)
            if pieces and "tool_calls" not in pieces[-1]:  # the last content delta carries the finish
                out[-1]["choices"][0].update(finish_reason=finish_reason, stop_reason=delta.stop_reason)
            else:
                out.append(_chunk(head, index, {}, self._take_logprobs(), finish_reason, delta.stop_reason))
        return out

    def _take_logprobs(self):
        held, self.held_logprobs = self.held_logprobs, None
        return None if held is None else {"content": held}
