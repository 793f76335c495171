"""The engine: `LLMEngine` (requests in, one step at a time, outputs back) and `AsyncLLM` (asyncio).

The engine owns the step loop: it asks the scheduler (jaxpaged/core) what to run, hands that to the
model runner (jaxpaged/worker), and turns the sampled tokens into `RequestOutput`s.
"""
