"""ServerConfig: what the HTTP layer needs to know (the engine has its own EngineArgs)."""

from __future__ import annotations

import dataclasses

from server.tool_parsers import AUTO, PARSERS

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # --reasoning-parser choices (server/reasoning.py)
TOOL_CALL_PARSERS = (AUTO, *PARSERS)  # --tool-call-parser choices (auto: by the model's template or family)
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a long chat with many messages fits; a runaway upload does not


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """served_model_names: names clients may pass as `model`; the first is the one reported."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_completion_logprobs: int = 5  # OpenAI's legacy completions cap
    max_chat_logprobs: int = 20
    enable_chat_page: bool = True  # the chat page at / (server/chat_page.py)
    enable_auto_tool_choice: bool = False  # vLLM's --enable-auto-tool-choice: tool_choice "auto" is served
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: how "auto" output is read as calls
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: the <think> span as reasoning_content
    data_parallel_rank: int | None = None  # a replica behind a router: its metrics carry replica=<rank>

    def __post_init__(self):
        names = tuple(self.served_model_names)
        object.__setattr__(self, "served_model_names", names)
        if not names or any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"ServerConfig.served_model_names={names!r}: need at least one non-empty name")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key='': use None for no key")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"ServerConfig.max_request_bytes={self.max_request_bytes!r}: must be >= 1024")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"ServerConfig.tool_call_parser={self.tool_call_parser!r}: choose one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"ServerConfig.reasoning_parser={self.reasoning_parser!r}: choose one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("ServerConfig.enable_auto_tool_choice needs a tool_call_parser "
                             "(--tool-call-parser)")
        if self.data_parallel_rank is not None and (not isinstance(self.data_parallel_rank, int)
                                                    or self.data_parallel_rank < 0):
            raise ValueError(f"ServerConfig.data_parallel_rank={self.data_parallel_rank!r}: must be >= 0")
        if not 0 <= self.max_completion_logprobs <= self.max_chat_logprobs <= 20:
            raise ValueError("ServerConfig: need 0 <= max_completion_logprobs <= max_chat_logprobs <= 20")

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
