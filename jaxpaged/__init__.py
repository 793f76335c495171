"""jaxpaged: an LLM serving engine on JAX/XLA (paged attention, continuous batching).

    from jaxpaged import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=64))
"""

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.errors import InvalidRequestError
from jaxpaged.llm import LLM
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "InvalidRequestError", "LLMEngine", "Logprob", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams",
           "__version__"]
