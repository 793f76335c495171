"""jaxpaged: an LLM serving engine on JAX/XLA (paged attention, continuous batching)."""

from jaxpaged.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "__version__"]
