"""The engine-control routes a trainer drives (API-key protected like every route but the public ones):

    POST /update_weights_from_disk  {"model_path": folder}  SGLang's name and field: the weights of a safetensors
                                                             folder of this model replace the engine's, between
                                                             steps -> {"success": true, "message", "seconds"}
    POST /sleep?level=1|2           vLLM's: free the KV cache's device memory (2: the weights' too) -> 200
    POST /wake_up                   vLLM's: back to serving -> 200
    GET  /is_sleeping               vLLM's -> {"is_sleeping": bool}

While asleep, generation requests get 503 in OpenAI's error shape (code "engine_asleep"); nothing is queued.
Errors are OpenAI-shaped: a bad folder or tensors 400 (param "model_path"), sleeping with requests unfinished 409.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from jaxpaged.engine.async_llm import EngineShutdownError
from jaxpaged.engine.weight_control import EngineSleepingError
from jaxpaged.models.weights import WeightLoadError
from jaxpaged.worker.live_weights import WeightUpdateError
from server.context import ServingContext
from server.errors import OpenAIError, bad_request, error_response


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str


def add_engine_control_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    @app.exception_handler(EngineSleepingError)
    async def _asleep(_: Request, err: EngineSleepingError):
        return error_response(503, str(err), code="engine_asleep")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        try:
            seconds = await engine.update_weights_from_disk(body.model_path)
        except (WeightLoadError, WeightUpdateError, OSError) as err:
            raise bad_request(str(err), "model_path") from None
        return {"success": True, "message": f"weights of {body.model_path} loaded in {seconds:.3f} s",
                "seconds": seconds}

    @app.post("/sleep")
    async def sleep(level: str = "1"):
        if level not in ("1", "2"):
            raise bad_request(f"level={level!r}: choose 1 (the KV cache) or 2 (the KV cache and the weights)", "level")
        try:
            await engine.sleep(int(level))
        except (EngineShutdownError, EngineSleepingError):
            raise
        except RuntimeError as err:
            raise OpenAIError(409, str(err), code="engine_busy") from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up():
        await engine.wake_up()
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}
