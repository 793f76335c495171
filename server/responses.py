"""POST /v1/responses: OpenAI's Responses API, the stateless subset vLLM serves.

`input` is a string (one user message) or a list of messages (`{"role", "content"}` with content a
string or `input_text` / `output_text` parts), `instructions` becomes a leading system message;
`max_output_tokens`, `temperature`, `top_p`, `seed` and `stream`. Nothing is stored (responses report
`store: false`), so `previous_response_id` is a 400; so are tools and non-text formats.

A stream is the Responses event sequence: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done, and
response.completed (response.incomplete when max_output_tokens cut it), each an SSE `event:` with
a `sequence_number`.

With --reasoning-parser, the model's <think> span becomes a `reasoning` output item (its text a
`reasoning_text` content part) before the message; streamed, it opens with its own
response.output_item.added, then response.reasoning_text.delta... and response.reasoning_text.done, and
closes before the message item opens. usage.output_tokens_details.reasoning_tokens counts its tokens.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxpaged.engine.async_llm import EngineShutdownError
from jaxpaged.outputs import RequestOutput
from server.chat import render_chat
from server.choices import ChoiceStream
from server.context import ServingContext
from server.errors import OpenAIError, bad_request, error_body
from server.params import build_sampling_params
from server.protocol import ChatMessage, Role, SamplingFields, Temperature, TextPart, TopP
from server.reasoning import ReasoningParser, ReasoningStream, reasoning_token_count
from server.serving import Submitted, check_finished_ok, until_disconnect

logger = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputMessage(_Body):
    type: str = "message"
    role: Role
    content: str | list[dict[str, Any]]


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _validate(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server is stateless and keeps no "
                          "responses; send the whole conversation as `input`", "previous_response_id")
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise bad_request(f"text.format type {fmt.get('type')!r} is not supported (only 'text')", "text")


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation: instructions as a system message, then the input."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return messages + [ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        if item.type != "message":
            raise bad_request(f"input[{i}].type={item.type!r} is not supported (only 'message')", "input")
        content = item.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") not in ("input_text", "output_text", "text") or \
                        not isinstance(part.get("text"), str):
                    raise bad_request(f"input[{i}]: content part type {part.get('type')!r} is not supported "
                                      "(only input_text / output_text)", "input")
                parts.append(TextPart(type="text", text=part["text"]))
            content = parts
        messages.append(ChatMessage(role=item.role, content=content))
    return messages


async def create_response(ctx: ServingContext, body: ResponsesRequest, request: Request):
    model = ctx.model_name(body.model)
    _validate(body)
    prompt = render_chat(ctx, _messages(body))
    parser = ctx.config.reasoning_parser
    reasoning = ReasoningParser.for_prompt(parser, prompt["prompt"]) if parser is not None else None
    fields = SamplingFields(temperature=body.temperature, top_p=body.top_p, seed=body.seed, stream=body.stream)
    params = build_sampling_params(fields, ctx.defaults, max_tokens=body.max_output_tokens, logprobs=None)
    rid = f"resp_{uuid.uuid4().hex}"
    submitted = ctx.submitted()
    await submitted.add(rid, prompt, params, "input")
    shell = _Shell(rid, f"msg_{uuid.uuid4().hex}", model, int(time.time()), body, params.max_tokens,
                   params.temperature, params.top_p)
    if body.stream:
        return StreamingResponse(_event_stream(_events(ctx, submitted, shell, reasoning), submitted),
                                 media_type="text/event-stream")
    (out,) = await until_disconnect(request, submitted.final_outputs(), submitted.abort)
    check_finished_ok([out])
    comp = out.outputs[0]
    thought, text = "", comp.text
    if reasoning is not None:
        split = reasoning.split(comp.text, True)
        thought, text = split.reasoning, split.content
    tokens = _reasoning_tokens(ctx, reasoning, comp.token_ids, comp.text)
    return shell.response(text, comp.finish_reason, out, thought, tokens)


def _reasoning_tokens(ctx: ServingContext, reasoning: ReasoningParser | None, token_ids: list[int], text: str) -> int:
    if reasoning is None:
        return 0
    return reasoning_token_count(lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True), token_ids,
                                 reasoning, text)


class _Shell:
    """The fixed parts of one response object, and the object at each stage."""

    def __init__(self, rid: str, msg_id: str, model: str, created: int, body: ResponsesRequest,
                 max_output_tokens: int | None, temperature: float, top_p: float):
        self.rid, self.msg_id, self.model, self.created, self.body = rid, msg_id, model, created, body
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.max_output_tokens, self.temperature, self.top_p = max_output_tokens, temperature, top_p

    def message(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [self.part(text)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def reasoning(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content,
                "encrypted_content": None, "status": status}

    def output(self, text: str, thought: str) -> list[dict]:
        return ([self.reasoning(thought, "completed")] if thought else []) + [self.message(text, "completed")]

    def response(self, text: str | None, finish_reason: str | None, out: RequestOutput | None, thought: str = "",
                 reasoning_tokens: int = 0) -> dict:
        """status in_progress (text None), completed, or incomplete (max_output_tokens reached)."""
        status = "in_progress" if text is None else "incomplete" if finish_reason == "length" else "completed"
        usage = None
        if out is not None:
            prompt, generated = len(out.prompt_token_ids), out.metrics.num_generation_tokens
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": prompt + generated}
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [] if text is None else self.output(text, thought),
            "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.body.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "previous_response_id": None, "store": False, "metadata": self.body.metadata or {},
            "user": self.body.user,
        }


async def _events(ctx: ServingContext, submitted: Submitted, shell: _Shell,
                  reasoning: ReasoningParser | None) -> AsyncIterator[dict]:
    yield {"type": "response.created", "response": shell.response(None, None, None)}
    yield {"type": "response.in_progress", "response": shell.response(None, None, None)}
    items = _ItemEvents(shell)
    state, split = ChoiceStream(), ReasoningStream(reasoning) if reasoning is not None else None
    final, token_ids = None, []
    if split is None:  # no reasoning item can come: the message opens at once
        for event in items.text("", opening=True):
            yield event
    async for _, out in submitted.outputs():
        delta = state.take(out.outputs[0])
        if delta is not None:
            token_ids += delta.token_ids
            thought, text = split.feed(delta.text, delta.finish_reason is not None) if split else ("", delta.text)
            for event in items.reasoning(thought) + items.text(text):
                yield event
        if out.finished:
            final = out
    for event in items.close():
        yield event
    comp = final.outputs[0]
    tokens = _reasoning_tokens(ctx, reasoning, token_ids, split.text if split is not None else "")
    response = shell.response(items.full_text, comp.finish_reason, final, items.full_thought, tokens)
    yield {"type": f"response.{response['status']}", "response": response}


class _ItemEvents:
    """The output items' events: a reasoning item while reasoning text comes, then the message item."""

    def __init__(self, shell: _Shell):
        self.shell, self.thoughts, self.texts = shell, [], []
        self.reasoning_open, self.message_open = False, False

    @property
    def full_thought(self) -> str:
        return "".join(self.thoughts)

    @property
    def full_text(self) -> str:
        return "".join(self.texts)

    def reasoning(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if not self.reasoning_open:
            self.reasoning_open = True
            events.append({"type": "response.output_item.added", "output_index": 0,
                           "item": self.shell.reasoning("", "in_progress")})
        self.thoughts.append(delta)
        return events + [{"type": "response.reasoning_text.delta", "item_id": self.shell.reasoning_id,
                          "output_index": 0, "content_index": 0, "delta": delta}]

    def _close_reasoning(self) -> list[dict]:
        if not self.reasoning_open:
            return []
        self.reasoning_open, thought = False, self.full_thought
        return [{"type": "response.reasoning_text.done", "item_id": self.shell.reasoning_id, "output_index": 0,
                 "content_index": 0, "text": thought},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": self.shell.reasoning(thought, "completed")}]

    def _at(self) -> dict:
        return {"item_id": self.shell.msg_id, "output_index": 1 if self.thoughts else 0, "content_index": 0}

    def text(self, delta: str, opening: bool = False) -> list[dict]:
        if not delta and not opening:
            return []
        events = []
        if not self.message_open:
            events = self._close_reasoning()
            self.message_open = True
            events += [{"type": "response.output_item.added", "output_index": self._at()["output_index"],
                        "item": self.shell.message("", "in_progress")},
                       {"type": "response.content_part.added", **self._at(), "part": self.shell.part("")}]
        if delta:
            self.texts.append(delta)
            events.append({"type": "response.output_text.delta", **self._at(), "delta": delta, "logprobs": []})
        return events

    def close(self) -> list[dict]:
        events = self.text("", opening=True) if not self.message_open else []
        text, at = self.full_text, self._at()
        return events + [
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": self.shell.part(text)},
            {"type": "response.output_item.done", "output_index": at["output_index"],
             "item": self.shell.message(text, "completed")}]


def _sse(event: dict, sequence_number: int) -> str:
    event = {**event, "sequence_number": sequence_number}
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _event_stream(events: AsyncIterator[dict], submitted: Submitted) -> AsyncIterator[str]:
    """Responses SSE framing; a failure after the start becomes an `error` event (the status is 200)."""
    n = 0
    try:
        async for event in events:
            yield _sse(event, n)
            n += 1
    except OpenAIError as err:
        yield _sse({"type": "error", **err.body()["error"]}, n)
    except EngineShutdownError as err:
        yield _sse({"type": "error", **error_body(503, f"the engine is not running: {err}")["error"]}, n)
    except Exception as err:
        logger.exception("streaming failed")
        yield _sse({"type": "error", **error_body(500, f"internal server error: {type(err).__name__}")["error"]}, n)
    finally:
        submitted.abort()
