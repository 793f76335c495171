"""The offline API, mirroring vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.loader import DEFAULT_MODEL
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | dict[str, Any] | Sequence[int]


@contextlib.contextmanager
def _start_up_progress():
    """The engine's start-up lines (loading, each step shape compiled, ready) on stderr while `LLM(...)` builds
    its engine, when the program has configured no logging: a cold start compiles for a minute and would
    otherwise be silent. A program that configured logging gets them through its own handlers instead."""
    package = logging.getLogger("jaxpaged")
    if logging.getLogger().handlers or package.handlers or package.level not in (logging.NOTSET, logging.INFO):
        yield
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(logging.NOTSET)


class LLM:
    """Batch generation over the continuous-batching engine; outputs come back in input order."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(names)}")
        with _start_up_progress():
            self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params or self.default_sampling_params(), len(prompts))
        # Only the finished outputs are wanted: the engine builds nothing per step (vLLM does the same).
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.llm_engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            self.llm_engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            # The template already wrote any BOS it wants: don't let the tokenizer add another.
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def update_weights(self, weights: Mapping[str, Any]) -> float:
        """Replace the model's weights in place, by Hugging Face parameter name (`get_weights()` lists them), all
        of them or any subset, without compiling again; docs/rl.md gives the contract. Each array in the
        checkpoint's shape ([out, in] for projections), numpy or jax.Array of any float dtype, on the host or
        already on the engine's devices (converted there). Raises WeightUpdateError (a ValueError; the engine keeps
        its weights) for a bad dict, EngineSleepingError at sleep level 2. Returns the seconds it took."""
        return self.llm_engine.update_weights(weights)

    def get_weights(self) -> dict[str, Any]:
        """The current weights {Hugging Face name: host numpy array} in the engine's dtype: the names and shapes
        update_weights takes (update_weights(get_weights()) changes nothing)."""
        return self.llm_engine.get_weights()

    def sleep(self, level: int = 1) -> None:
        """Free device memory between uses (vLLM's name): level 1 the KV cache's, level 2 the weights' too (kept
        on the host). generate() while asleep raises EngineSleepingError; wake_up() restores."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Undo sleep(): same weights, an empty KV cache; outputs as before sleeping."""
        self.llm_engine.wake_up()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for output in self.llm_engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update()
        return [results[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
