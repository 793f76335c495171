"""GRPO on SmolLM2 with optax on the CPU: the trainer and the jaxpaged engine in one process (docs/rl.md).

Each step: rollouts (n samples per prompt, the engine's sampled-token log-probs as arrays) -> rewards on a
verifiable task (small sums: the completion's first number is the answer) -> the GRPO loss over the trainer's own
forward (`jaxpaged.models.llama.forward`, plain JAX, the same weights) -> one optax step -> `LLM.update_weights`
-> the next rollouts. The engine runs in batch-invariant mode, so a sample's log-probs do not depend on what else
was in its batch; the trainer's forward of the same weights gives them again, within 1e-5 (printed each step:
`max |engine - trainer|`, per token and per sequence).

    python examples/grpo_smollm2.py                       # SmolLM2-135M-Instruct, 3 steps
    python examples/grpo_smollm2.py --steps 5 --samples 8 --learning-rate 2e-6

The loss is GRPO's (DeepSeekMath): per prompt, each sample's advantage is its reward minus the group's mean over
the group's standard deviation; the clipped ratio of the new policy's token probabilities to the rollout's
(exp(logp - logp_rollout), from the engine's log-probs), averaged over the completions' tokens; no KL term (one
policy step per rollout batch, as DAPO drops it).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import llama
from jaxpaged.worker.live_weights import hf_slots, to_hf

CLIP = 0.2  # PPO/GRPO ratio clip


def task(seed: int, count: int) -> list[tuple[str, int]]:
    """`count` questions "What is a + b?" with their answers (a, b in 1..20)."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(1, 21, size=(count, 2))
    return [(f"What is {a} + {b}? Answer with the number only.", int(a + b)) for a, b in pairs]


def reward(text: str, answer: int) -> float:
    """1 if the completion's first number is the answer, 0.1 if it gives another number, else 0."""
    found = re.search(r"-?\d+", text)
    if found is None:
        return 0.0
    return 1.0 if int(found.group()) == answer else 0.1


def params_from_hf(config: llama.LlamaConfig, weights: dict[str, np.ndarray]) -> llama.Params:
    """{Hugging Face name: array} (`LLM.get_weights()`) -> the checkpoint-layout params `llama.forward` takes
    (layers stacked), float32."""
    layers: dict[str, list] = {}
    params: llama.Params = {}
    for name, slot in hf_slots(config).items():
        value = np.asarray(slot.to_ours(np.asarray(weights[name], np.float32)))
        if slot.layer is None:
            params[slot.key] = value
        else:
            layers.setdefault(slot.key, [None] * config.num_hidden_layers)[slot.layer] = value
    params["layers"] = {key: np.stack(values) for key, values in layers.items()}
    return jax.tree.map(jnp.asarray, params)


def params_to_hf(config: llama.LlamaConfig, params: llama.Params) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf`: what `LLM.update_weights` takes (host numpy arrays)."""
    host = jax.device_get(params)
    out = {}
    for name, slot in hf_slots(config).items():
        value = host[slot.key] if slot.layer is None else host["layers"][slot.key][slot.layer]
        out[name] = np.ascontiguousarray(to_hf(slot.key, value))
    return out


def rollouts(llm: LLM, prompts: Sequence[list[int]], samples: int, max_tokens: int, seed: int) -> list[dict]:
    """n = samples completions per prompt, each {group, prompt, completion, logprobs (f32[len]), text}."""
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, seed=seed, array_logprobs=True)
    out = []
    for group, result in enumerate(llm.generate([list(p) for p in prompts], params, use_tqdm=False)):
        for sample in result.outputs:
            out.append(dict(group=group, prompt=list(result.prompt_token_ids), completion=list(sample.token_ids),
                            logprobs=sample.token_logprobs, text=sample.text))
    return out


def batch_arrays(samples: Sequence[dict], pad_id: int) -> dict[str, np.ndarray]:
    """tokens i32[B, L] (prompt then completion, right-padded), mask f32[B, L - 1] (1 where the target token
    tokens[:, 1:] is a completion token) and old f32[B, L - 1] (the engine's log-probs there)."""
    length = max(len(s["prompt"]) + len(s["completion"]) for s in samples)
    length += -length % 8  # fewer shapes to compile across steps
    tokens = np.full((len(samples), length), pad_id, np.int32)
    mask = np.zeros((len(samples), length - 1), np.float32)
    old = np.zeros((len(samples), length - 1), np.float32)
    for i, s in enumerate(samples):
        p, c = len(s["prompt"]), len(s["completion"])
        tokens[i, :p + c] = s["prompt"] + s["completion"]
        mask[i, p - 1:p - 1 + c] = 1.0
        old[i, p - 1:p - 1 + c] = s["logprobs"]
    return dict(tokens=tokens, mask=mask, old=old)


def token_logprobs(config: llama.LlamaConfig, params: llama.Params, tokens: jax.Array) -> jax.Array:
    """The trainer's forward: log p(tokens[:, t + 1] | tokens[:, :t + 1]) f32[B, L - 1]."""
    logits = llama.forward(config, params, tokens[:, :-1])  # f32[B, L - 1, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def grpo_loss(params, config, tokens, mask, old, advantages):
    """GRPO's clipped objective, negated, averaged over the completions' tokens; also the new log-probs."""
    logp = token_logprobs(config, params, tokens)
    ratio = jnp.exp(logp - old)
    adv = advantages[:, None]
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv)
    return -jnp.sum(objective * mask) / jnp.maximum(jnp.sum(mask), 1.0), logp


def advantages(samples: Sequence[dict], rewards: np.ndarray) -> np.ndarray:
    """Each sample's reward minus its group's mean, over the group's std (+1e-4): f32[B]."""
    groups = np.array([s["group"] for s in samples])
    adv = np.zeros(len(samples), np.float32)
    for g in np.unique(groups):
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std() + 1e-4)
    return adv


def train_step(llm: LLM, config, state: dict, prompts, answers, args, step: int) -> dict:
    """One GRPO step: rollouts, rewards, the loss's gradient, an optax update, `update_weights`. Returns the
    step's figures (reward, loss, engine-vs-trainer log-prob gaps, seconds)."""
    t0 = time.perf_counter()
    samples = rollouts(llm, prompts, args.samples, args.max_tokens, seed=args.seed + step)
    t1 = time.perf_counter()
    rewards = np.array([reward(s["text"], answers[s["group"]]) for s in samples], np.float32)
    arrays = batch_arrays(samples, pad_id=0)
    (loss, logp), grads = state["grad"](state["params"], config, arrays["tokens"], arrays["mask"], arrays["old"],
                                        advantages(samples, rewards))
    gap = np.abs(np.asarray(logp) - arrays["old"]) * arrays["mask"]  # the rollout's weights: ratio 1
    seq_gap = np.abs(((np.asarray(logp) - arrays["old"]) * arrays["mask"]).sum(axis=1))
    updates, state["opt"] = state["optimizer"].update(grads, state["opt"], state["params"])
    state["params"] = optax.apply_updates(state["params"], updates)
    t2 = time.perf_counter()
    llm.update_weights(params_to_hf(config, state["params"]))
    t3 = time.perf_counter()
    return dict(step=step, reward=float(rewards.mean()), loss=float(loss), max_token_gap=float(gap.max()),
                max_sequence_gap=float(seq_gap.max()), tokens=int(arrays["mask"].sum()),
                rollout_s=t1 - t0, train_s=t2 - t1, update_s=t3 - t2)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    llm = LLM(args.model, dtype="float32", batch_invariant=True, max_model_len=args.max_model_len,
              max_num_seqs=args.prompts * args.samples, seed=args.seed)
    config = llm.llm_engine.model.config
    tokenizer = llm.get_tokenizer()
    questions = task(args.seed, args.prompts)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q, _ in questions]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]  # the template wrote BOS
    params = params_from_hf(config, llm.get_weights())
    optimizer = optax.adam(args.learning_rate)
    grad = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnums=1)
    state = dict(params=params, optimizer=optimizer, opt=optimizer.init(params), grad=grad)
    history = []
    for step in range(args.steps):
        row = train_step(llm, config, state, prompts, [a for _, a in questions], args, step)
        history.append(row)
        print(f"step {step}: reward {row['reward']:.3f}  loss {row['loss']:+.4f}  max |engine - trainer| log-prob "
              f"per token {row['max_token_gap']:.2e}, per sequence {row['max_sequence_gap']:.2e}  "
              f"({row['tokens']} tokens; rollout {row['rollout_s']:.1f} s, train {row['train_s']:.1f} s, "
              f"update_weights {row['update_s']:.2f} s)", flush=True)
    return history


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="questions a step")
    p.add_argument("--samples", type=int, default=4, help="completions per question (GRPO's group)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
