"""What structured outputs cost a serving batch: output tok/s with half the requests JSON-schema
constrained vs the same load unconstrained, side by side in one run (one server, one warm-up).

    PYTHONPATH=. python scripts/bench_structured_outputs.py --model smollm2-135m-instruct --concurrency 32

Loads, each `--concurrency` chat requests sent at once through the OpenAI API (an in-process
server on 127.0.0.1):
  unconstrained      every request free text (ignore_eos, `--max-tokens` tokens)
  half constrained   every other request constrained by a JSON schema (response_format json_schema),
                     the rest as above
  unconstrained (2)  the first load again: how much the figures move between identical runs (noise)

Output tok/s = completion tokens (the server's usage) / the load's wall time. The constrained load
must keep >= 80% of the unconstrained figure (issue 16); the grammar's per-step cost (llguidance's
bitmask, the sampler's mask) is the difference. The rounds alternate (`--rounds`) so drift from other
work on the machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 30},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "hobbies", "employed"], "additionalProperties": False}
PROMPTS = ["Describe a person who lives in {}.", "Invent a character from {}.", "Tell me about someone from {}."]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul"]


def request_body(i: int, constrained: bool, max_tokens: int, model: str) -> dict:
    prompt = PROMPTS[i % len(PROMPTS)].format(CITIES[i % len(CITIES)])
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": i}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    return body


async def run_load(url: str, model: str, concurrency: int, max_tokens: int, constrained_every: int) -> dict:
    """`concurrency` requests at once; every `constrained_every`-th constrained (0: none)."""
    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [request_body(i, bool(constrained_every) and i % constrained_every == 0, max_tokens, model)
                  for i in range(concurrency)]
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = constrained_tokens = valid = constrained = 0
    for body, reply in zip(bodies, replies):
        reply.raise_for_status()
        data = reply.json()
        tokens += data["usage"]["completion_tokens"]
        if "response_format" in body:
            constrained += 1
            constrained_tokens += data["usage"]["completion_tokens"]
            try:
                json.loads(data["choices"][0]["message"]["content"])
                valid += 1
            except ValueError:
                pass
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "constrained": constrained,
            "constrained_tokens": constrained_tokens, "valid_json": valid}


def start_server(args):
    from jaxpaged.engine.async_llm import AsyncLLM
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    from server.app import build_app
    from server.config import ServerConfig
    from tests.server.conftest import serve

    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len,
                                  max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens))
    llm = AsyncLLM(engine)
    return llm, serve(build_app(llm, ServerConfig(served_model_names=(args.model,))), timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="times each load runs (alternating)")
    args = p.parse_args()
    llm, server = start_server(args)
    with server as url:
        asyncio.run(run_load(url, args.model, 4, 8, 2))  # compiles the schema, touches every path once
        rows: dict[str, list[dict]] = {"unconstrained": [], "half constrained": []}
        for _ in range(args.rounds):
            rows["unconstrained"].append(asyncio.run(run_load(url, args.model, args.concurrency, args.max_tokens, 0)))
            rows["half constrained"].append(asyncio.run(run_load(url, args.model, args.concurrency,
                                                                 args.max_tokens, 2)))
    llm.shutdown()
    print(f"{args.concurrency} concurrent chat requests, {args.max_tokens} max tokens, model {args.model}")
    print(f"{'load':<18} {'round':>5} {'wall s':>8} {'out tokens':>10} {'out tok/s':>10} {'valid JSON':>10}")
    for name, results in rows.items():
        for i, r in enumerate(results):
            valid = f"{r['valid_json']}/{r['constrained']}" if r["constrained"] else "-"
            print(f"{name:<18} {i:>5} {r['wall_s']:>8.2f} {r['tokens']:>10} {r['tok_s']:>10.1f} {valid:>10}")
    free = [r["tok_s"] for r in rows["unconstrained"]]
    half = [r["tok_s"] for r in rows["half constrained"]]
    ratio = (sum(half) / len(half)) / (sum(free) / len(free))
    spread = (max(free) - min(free)) / (sum(free) / len(free))
    print(f"half constrained / unconstrained output tok/s: {ratio:.2f} (target >= 0.80); "
          f"unconstrained round-to-round spread: {spread:.0%}")


if __name__ == "__main__":
    main()
