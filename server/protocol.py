"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Unknown fields are ignored, as OpenAI's SDKs send a few we do not use. Every limit a field has on its
own (ranges, lengths, allowed values) is declared here, so one source drives both the validation (a
400 naming the field) and the published schema (/openapi.json, which clients and fuzzers read). What
depends on more than the field stays in the handlers and the engine, whose InvalidRequestError (naming
the parameter) is a 400 too: token ids against the vocabulary, the prompt against the context,
min_tokens against max_tokens, the server's configured logprobs caps.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpaged.sampling_params import MAX_LOGPROBS

# Request-shape caps of the HTTP API. The engine checks token ids against the vocabulary and the sampler's
# room for biased + banned ids (jaxpaged/engine/validation.py); these keep a request well inside that room.
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's cap; the sampler has room for 320 (the rest: banned ids)
MAX_STOP_TOKEN_IDS = 16  # banned until min_tokens, together with logit_bias and EOS ids
MAX_STOP_STRINGS = 16
MAX_N = 128

Role = Literal["system", "developer", "user", "assistant", "tool"]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False, description="0 means greedy")]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # logit_bias keys: token ids written as strings
Bias = Annotated[float, Field(ge=-100, le=100)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's {"name", "description", "schema", "strict"}."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` extra body: one of json, regex, choice, grammar, json_object."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Temperature | None = None  # unset: the model's generation_config default, else 1
    top_p: TopP | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    seed: int | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, description="-1 or 0: no top-k cut")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Logprobs | None = None  # top-k per prompt token (vLLM's)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None


class CompletionRequest(SamplingFields):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt alone (its logprobs)
    echo: bool = False
    logprobs: Logprobs | None = None  # the server's cap (ServerConfig.max_completion_logprobs) may be lower
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only best_of == n is served


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a `tool` turn: the call it answers


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking)


class TokenizeRequest(_Body):
    """Exactly one of prompt and messages (the handler checks the pair)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
