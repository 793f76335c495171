"""InvalidRequestError: the one typed error for a request that can never be served.

Raised by `SamplingParams`, by `LLMEngine.add_request` (see jaxpaged/engine/validation.py)
and by the scheduler's admission; nothing of the request is queued. `param` names
the offending parameter (a `SamplingParams` field, or "prompt"), which the server
puts in OpenAI's 400 body as it is: no message text is parsed.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served; nothing of it was queued. `param`: the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


__all__ = ["InvalidRequestError"]
