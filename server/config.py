"""ServerConfig: what the HTTP layer needs to know (the engine has its own EngineArgs)."""

from __future__ import annotations

import dataclasses

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

    def __post_init__(self):
        names = tuple(self.served_model_names)
        object.__setattr__(self, "served_model_names", names)
        if not names or any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"ServerConfig.served_model_names={names!r}: need at least one non-empty name")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key='': use None for no key")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"ServerConfig.max_request_bytes={self.max_request_bytes!r}: must be >= 1024")
        if not 0 <= self.max_completion_logprobs <= self.max_chat_logprobs <= 20:
            raise ValueError("ServerConfig: need 0 <= max_completion_logprobs <= max_chat_logprobs <= 20")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
