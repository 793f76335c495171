"""GRPO on SmolLM2 with optax on the CPU: the trainer and the jaxpaged engine in one process (docs/rl.md).

Each step: rollouts (n samples per prompt, the engine's sampled-token log-probs as arrays) -> rewards on a
verifiable task (small sums: the completion's first number is the answer) -> the GRPO loss over the trainer's own
forward (jaxpaged.models.llama's decoder layer in JAX over the same weights; its dots, norm sums, attention,
RoPE tables and log-sum-exp on the engine's native CPU kernels, the gradients XLA's) -> one optax step ->
`LLM.update_weights` -> the next rollouts. The engine runs in batch-invariant mode, so a sample's log-probs do not
depend on what else was in its batch; the trainer's forward of the same weights gives them again: each step prints
`max |engine - trainer|` per token and per sequence (0: the same bits, on SmolLM2 and the test's tiny model;
docs/rl.md).

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
from jaxpaged.models.params import fuse_gate_up, fuse_qkv
from jaxpaged.models.weight_dots import Matmul
from jaxpaged.worker.live_weights import hf_slots, to_hf
from jaxpaged.worker.runner_config import cpu_compiler_options
from pallas_kernels import cpu_attention, cpu_matmul, cpu_rope, cpu_sampler

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


@jax.custom_vjp
def native_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] on the engine's native CPU matmul (each row summed over K in its order), with XLA's
    dots for the gradient."""
    return cpu_matmul.matmul_cpu(x, w, any_rows=True)


native_dot.defvjp(lambda x, w: (native_dot(x, w), (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


@jax.custom_vjp
def native_row_sums(x: jax.Array) -> jax.Array:
    """x [..., K] -> sums [..., 1] as the engine's batch-invariant norms take them."""
    return cpu_matmul.row_sums_cpu(x)


native_row_sums.defvjp(lambda x: (native_row_sums(x), x.shape), lambda shape, g: (jnp.broadcast_to(g, shape),))


def native_attention(config: llama.LlamaConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of B sequences of T tokens, q [B, T, H, D], k/v [B, T, K, D], on the engine's native CPU
    kernel as batch-invariant mode runs it (each query on its own), its K/V laid out as a page pool of T-token
    pages (page 0 the null page); the gradient is `llama.causal_attention`'s."""

    @jax.custom_vjp
    def attend(q, k, v):
        b, t, h, d = q.shape
        pool = lambda x: jnp.concatenate([jnp.zeros((x.shape[2], 1, t, d), x.dtype),
                                          x.transpose(2, 0, 1, 3)], axis=1)  # [K, 1 + B, T, D]
        out = cpu_attention.ragged_paged_attention_cpu(
            q.reshape(b * t, h, d), pool(k), pool(v), jnp.full((b,), t, jnp.int32),
            jnp.arange(1, b + 1, dtype=jnp.int32)[:, None], jnp.arange(0, b * t + 1, t, dtype=jnp.int32),
            jnp.int32(b), sm_scale=config.attn_scale, query_tiles=False)
        return out.reshape(b, t, h, d)

    def backward(res, g):
        return jax.vjp(lambda *x: llama.causal_attention(*x, config.attn_scale), *res)[1](g)

    attend.defvjp(lambda q, k, v: (attend(q, k, v), (q, k, v)), backward)
    return attend(q, k, v)


@jax.custom_vjp
def native_log_softmax(logits: jax.Array) -> jax.Array:
    """log_softmax over the last axis with the engine's per-row log-sum-exp (cpu_sampler.row_stats_cpu, sums in
    double), logits f32[R, V]."""
    return logits - cpu_sampler.row_stats_cpu(logits, logits)[1][:, None]


native_log_softmax.defvjp(
    lambda x: (native_log_softmax(x), x),
    lambda x, g: (g - jax.nn.softmax(x, axis=-1) * jnp.sum(g, axis=-1, keepdims=True),))


def trainer_matmul() -> Matmul | None:
    """The trainer's weight dots and norm sums: the engine's own products where they build (so its forward
    reproduces the engine's log-probs closely), else None (XLA's)."""
    if jax.default_backend() != "cpu" or not all(m.SOURCE and load() for m, load in (
            (cpu_matmul, cpu_matmul.load_cpu_matmul), (cpu_attention, cpu_attention.load_cpu_attention),
            (cpu_rope, cpu_rope.load_cpu_rope), (cpu_sampler, cpu_sampler.load_cpu_sampler))):
        return None
    return Matmul(native_dot, lambda x, w: x.ndim == 2 and x.dtype == w.dtype == jnp.float32,
                        native_row_sums)


def token_logprobs(config: llama.LlamaConfig, params: llama.Params, tokens: jax.Array) -> jax.Array:
    """The trainer's forward (jaxpaged.models.llama's decoder layer over the stacked checkpoint-layout params,
    the batch's tokens as rows, causal attention per sequence): log p(tokens[:, t + 1] | tokens[:, :t + 1])
    f32[B, L - 1]."""
    inputs, matmul = tokens[:, :-1], trainer_matmul()
    native = matmul is not None  # the engine's kernels, as its batch-invariant step runs them
    b, t = inputs.shape
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = (cpu_rope.rope_tables_cpu(positions, llama.rope_frequencies(config)) if native else
                llama.rope_tables(config, positions))  # [U, T, D]
    cos, sin = jnp.tile(cos[0], (b, 1)), jnp.tile(sin[0], (b, 1))  # [B * T, D]

    def attend(q, k, v):  # [B * T, heads, D] -> per sequence
        split = lambda x: x.reshape(b, t, *x.shape[1:])
        out = (native_attention(config, split(q), split(k), split(v)) if native else
               llama.causal_attention(split(q), split(k), split(v), config.attn_scale))
        return out.reshape(b * t, *out.shape[2:]), None

    def layer(h, p):  # q/k/v and gate/up fused as the engine holds them: one product each, on `matmul`
        fused = {n: w for n, w in p.items() if n not in ("wq", "wk", "wv", "w_gate", "w_up")}
        fused.update(wqkv=fuse_qkv(config, p["wq"], p["wk"], p["wv"]),
                     w_gate_up=fuse_gate_up(p["w_gate"], p["w_up"]))
        return llama.decoder_layer(config, fused, h, cos, sin, attend, matmul)[0], None

    h = llama.embed_tokens(params, inputs.reshape(-1), config)  # [B * T, E]
    h, _ = jax.lax.scan(layer, h, params["layers"])
    head = params if "lm_head" in params else dict(params, lm_head=params["embed"].T)  # a tied head's [E, V]
    logits = llama.lm_logits(config, head, h, matmul)  # f32[B * T, V]
    logp = (native_log_softmax(logits) if native else jax.nn.log_softmax(logits, axis=-1)).reshape(b, t, -1)
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
    # the trainer's forward of the rollout's weights, on its own: the gradient's program fuses the forward with
    # its backward, which rounds some element-wise steps otherwise (~1e-7 a layer); alone it is the engine's math
    logp = state["forward"](config, state["params"], arrays["tokens"])
    (loss, _), grads = state["grad"](state["params"], config, arrays["tokens"], arrays["mask"], arrays["old"],
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
    # compiled as the engine's steps are in batch-invariant mode (XLA's own codegen: no library fusions, whose
    # elementwise math rounds otherwise)
    options = cpu_compiler_options(num_tokens=1)
    grad = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnums=1, compiler_options=options)
    forward = jax.jit(token_logprobs, static_argnums=0, compiler_options=options)
    state = dict(params=params, optimizer=optimizer, opt=optimizer.init(params), grad=grad, forward=forward)
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
