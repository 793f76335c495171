"""What every handler needs: the engine, the server config, the metrics, model facts."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.sample.structured_outputs import GrammarError
from server.config import ServerConfig
from server.errors import OpenAIError, bad_request
from server.metrics import ServerMetrics
from server.serving import Submitted
from server.tool_parsers import resolve_parser_name


@dataclasses.dataclass(frozen=True)
class ServingContext:
    engine: AsyncLLM
    config: ServerConfig
    metrics: ServerMetrics
    tool_parser: str | None = None  # the format "auto" tool choice reads (--tool-call-parser, auto resolved)

    @classmethod
    def create(cls, engine: AsyncLLM, config: ServerConfig) -> ServingContext:
        """The context of an app; ValueError when --tool-call-parser auto cannot tell the model's format."""
        parser = None
        if config.auto_tool_choice:
            family = engine.engine.model.config.architecture
            parser = resolve_parser_name(config.tool_call_parser, engine.tokenizer.chat_template, family)
        rank = config.data_parallel_rank
        metrics = ServerMetrics(engine, config.model_name, engine.max_model_len, None if rank is None else str(rank))
        return cls(engine, config, metrics, parser)

    @property
    def tokenizer(self):
        """The model's tokenizer (it carries the chat template)."""
        return self.engine.tokenizer

    @property
    def defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM does the same)."""
        return self.engine.generation_defaults

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def model_name(self, requested: str | None) -> str:
        """The name to report; 404 in OpenAI's shape for a model this server does not serve."""
        if requested is None:
            return self.config.model_name
        if requested not in self.config.served_model_names:
            raise OpenAIError(404, f"The model `{requested}` does not exist. Served: "
                                   f"{', '.join(self.config.served_model_names)}", "model", "model_not_found")
        return requested

    async def compile_constraint(self, spec: StructuredOutputsParams | None, param: str | None) -> None:
        """Compile an output constraint off the engine thread before the request is queued: a bad one
        (invalid, unsatisfiable, too large, too slow) is a 400 naming `param`, and nothing is queued."""
        if spec is None:
            return
        manager = self.engine.engine.structured_outputs
        timeout = manager.config.compile_timeout_s
        try:  # shielded: a timeout here must not cancel the compile other requests may share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(manager.compile(spec))), timeout)
        except asyncio.TimeoutError:
            raise bad_request(f"compiling the {spec.kind} constraint took longer than {timeout:g} s; "
                              "simplify it", param) from None
        except GrammarError as err:
            raise bad_request(str(err), param) from None

    def submitted(self) -> Submitted:
        return Submitted(self.engine, self.metrics)
