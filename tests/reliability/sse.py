"""A small SSE client over httpx for the reliability tests."""

from __future__ import annotations

import dataclasses
import json

import httpx


@dataclasses.dataclass
class StreamResult:
    status: int
    chunks: list[dict]
    done: bool  # saw `data: [DONE]`
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: dict | None = None  # the JSON body of a non-200 answer

    @property
    def errors(self) -> list[dict]:
        return [c["error"] for c in self.chunks if "error" in c]

    @property
    def usage(self) -> dict | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)

    def text(self, chat: bool) -> str:
        if chat:
            return "".join(ch["delta"].get("content") or "" for c in self.chunks for ch in c.get("choices", ()))
        return "".join(ch.get("text") or "" for c in self.chunks for ch in c.get("choices", ()))


async def stream(client: httpx.AsyncClient, path: str, body: dict, max_events: int | None = None,
                 timeout: float = 60.0) -> StreamResult:
    """POST a streaming request; read every event (or only `max_events`, then drop the connection)."""
    chunks, done = [], False
    async with client.stream("POST", path, json={**body, "stream": True}, timeout=timeout) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamResult(response.status_code, [], False, dict(response.headers), response.json())
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            chunks.append(json.loads(payload))
            if max_events is not None and len(chunks) >= max_events:
                break  # leaving the `async with` closes the connection mid-stream
    return StreamResult(200, chunks, done)


def assert_error_shape(body: dict) -> dict:
    """OpenAI's shape {"error": {"message", "type", "param", "code"}}; returns the inner dict."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return error
