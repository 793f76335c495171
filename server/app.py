"""The application factory: `build_app(engine, config)` -> FastAPI (no module-level engine)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

import jaxpaged
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.engine.validation import check_token_ids
from server.chat import create_chat_completion, render_chat
from server.chat_page import add_chat_page
from server.completions import create_completion
from server.config import ServerConfig
from server.context import ServingContext
from server.engine_control import add_engine_control_routes
from server.errors import bad_request, install_handlers
from server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.responses import ResponsesRequest, create_response


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """An OpenAI-compatible app over a running AsyncLLM; the caller owns (and shuts down) the engine."""
    app = FastAPI(title="jaxpaged", version=jaxpaged.__version__, docs_url=None, redoc_url=None)
    ctx = ServingContext.create(engine, config)
    app.state.ctx = ctx
    install_handlers(app)
    _openai_routes(app, ctx)
    _utility_routes(app, ctx)
    add_engine_control_routes(app, ctx)
    if config.enable_chat_page:
        add_chat_page(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:  # added last = outermost: no body is read for a request without the key
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


def _openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    created = int(time.time())

    @app.get("/v1/models")
    async def list_models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "jaxpaged", "root": name,
                 "max_model_len": ctx.max_model_len} for name in ctx.config.served_model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(ctx, body, request)


def _utility_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health():
        if not ctx.engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxpaged.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = render_chat(ctx, body.messages, body.add_generation_prompt,
                              template_kwargs=body.chat_template_kwargs)["prompt_token_ids"]
        else:
            ids = list(ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.model_name(body.model)
        check_token_ids(body.tokens, ctx.vocab_size, "tokens")  # InvalidRequestError: a 400 naming "tokens"
        return {"prompt": ctx.tokenizer.decode(body.tokens)}
