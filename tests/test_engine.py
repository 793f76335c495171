"""The engine end to end on CPU: paged continuous batching equals the plain forward, token for token."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.errors import InvalidRequestError
from jaxpaged.models.llama import forward_jit
from jaxpaged.models.loader import load_model
from jaxpaged.models.params import UNFUSED
from jaxpaged.models.weight_dots import PackedWeight
from jaxpaged.sampling_params import SamplingParams
from pallas_kernels.cpu_matmul import dequantize_int8, quantize_int8, quantize_rows_int8
from tests.greedy_oracle import greedy_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_pages=200,
                  compilation_cache_dir=None)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


def make_engine(loaded, **overrides) -> LLMEngine:
    return LLMEngine(dataclasses.replace(BASE, **overrides), loaded=loaded)


def run_all(engine: LLMEngine, prompts, params=GREEDY) -> dict[str, list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.scheduler.check_invariants()
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return done


def mixed_prompts(count=32, seed=0, vocab=256, max_len=100):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=count)
    if count >= 3:
        lengths[:3] = (1, 16, 17)  # page boundaries
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


@contextlib.contextmanager
def count_traces():
    """Every jaxpr trace (a jit cache miss: what precedes any compile) while inside."""
    events = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            events.append((event, _))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("overrides, expect", [
    ({}, "cache"),
    (dict(enable_prefix_caching=False), "nocache"),
    (dict(num_pages=24), "preempt"),
    (dict(max_num_batched_tokens=16, max_num_seqs=8), "chunked"),
])
def test_greedy_batch_equals_plain_forward(tiny, overrides, expect):
    prompts = mixed_prompts()
    if expect == "cache":  # repeated prompts and shared prefixes exercise the cache
        prompts[10] = prompts[11][:] if len(prompts[11]) > 20 else prompts[10]
        prompts[12] = prompts[13][:18] + prompts[12]
    engine = make_engine(tiny, **overrides)
    done = run_all(engine, prompts)
    for i, prompt in enumerate(prompts):
        expected = greedy_generate(tiny.config, tiny.params, prompt, GREEDY.max_tokens)
        assert done[str(i)].outputs[0].token_ids == expected, f"prompt {i} (len {len(prompt)})"
        assert done[str(i)].outputs[0].finish_reason == "length"
    if expect == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if expect == "chunked":
        assert max(map(len, prompts)) > engine.runner_config.max_num_batched_tokens
    if expect == "nocache":
        assert engine.scheduler.pool.prefix_cache_hits == 0


def test_cpu_engine_gives_one_request_one_sequence_slot(tiny):
    """On CPU the smallest S bucket is 1: one request's decode step computes one logits row (not 4, 3 of
    them padding) and still matches the plain forward. Its T buckets are doublings where the runner packs the
    weights (their dots skip padding rows) and add x1.5 steps from 32 tokens on where XLA's dots run."""
    engine = make_engine(tiny)
    assert engine.runner_config.seq_buckets[0] == 1 and engine.runner_config.bucket_for(1, 1, 1)[:2] == (1, 1)
    assert engine.runner_config.mid_token_buckets_from is None
    assert all(t & (t - 1) == 0 or t == engine.runner_config.max_num_batched_tokens
               for t in engine.runner_config.token_buckets)
    assert make_engine(tiny, attention_backend="xla").runner_config.mid_token_buckets_from == 32
    done = run_all(engine, [[5, 6, 7]])
    assert done["0"].outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, [5, 6, 7], GREEDY.max_tokens)
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()  # the prefill; the next step is one decode
    step = engine.runner.prepare(engine.scheduler.schedule().scheduled_requests)
    assert step.page_table.shape[0] == 1 and engine.runner.execute(step).shape == (1, tiny.config.vocab_size)


def test_smollm2_greedy_batch_equals_plain_forward(smollm2):
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,",
             "The quick brown fox jumps over the lazy dog. " * 6, "Water boils at"] * 6
    prompts = [tok(t)["input_ids"] for t in texts[:32]]
    engine = LLMEngine(EngineArgs(model="unused", max_model_len=256, max_num_seqs=32, max_num_batched_tokens=128,
                                  num_pages=300, compilation_cache_dir=None), loaded=smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    done = run_all(engine, prompts, params)
    expected = {}  # the plain forward once per distinct prompt (6 of the 32): it recomputes every position
    for i, prompt in enumerate(prompts):
        if tuple(prompt) not in expected:
            expected[tuple(prompt)] = greedy_generate(smollm2.config, smollm2.params, prompt, 10)
        assert done[str(i)].outputs[0].token_ids == expected[tuple(prompt)], texts[i]


def test_shared_prefix_shares_pages(tiny):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 256, size=200).tolist()
    prompts = [prefix + rng.integers(0, 256, size=20).tolist() for _ in range(8)]
    engine = make_engine(tiny, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8, num_pages=200,
                         max_num_partial_prefills=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    # one limit, one value: the scheduler enforces what attention was compiled for
    assert engine.scheduler.config.max_num_partial_prefills == engine.runner_config.max_num_partial_prefills == 8
    engine.step()  # all eight prefilled in one step
    pool = engine.scheduler.pool
    pages_in_use = pool.num_usable_pages - pool.num_free_pages
    # 220 tokens = 14 pages each if copied; the 12 full prefix pages are shared: 12 + 8 * 2.
    assert pages_in_use == 12 + 8 * 2 < 8 * 14
    assert pool.prefix_cache_hits == 7 * 12 * 16
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, prompt, 12)
    assert pool.num_free_pages == pool.num_usable_pages


def test_seeded_sampling_is_batch_independent(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = mixed_prompts(1, seed=9)[0]
    alone = run_all(engine, [prompt], params)["0"].outputs[0].token_ids
    others = mixed_prompts(7, seed=10)
    mixed = [SamplingParams(temperature=0.7, seed=s, max_tokens=5 + s, ignore_eos=True) for s in range(7)]
    batch = run_all(engine, others[:4] + [prompt] + others[4:], mixed[:4] + [params] + mixed[4:])
    assert batch["4"].outputs[0].token_ids == alone


def test_n_samples_with_seed_differ_and_reproduce(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=4, temperature=1.5, seed=7, max_tokens=10, ignore_eos=True)
    prompt = list(range(40))
    first = run_all(engine, [prompt], params)["0"]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert len(set(samples)) == 4
    again = run_all(engine, [prompt], params)["0"]
    assert [tuple(o.token_ids) for o in again.outputs] == samples


def int8_values(params, packed: set[str]):
    """Checkpoint-layout params whose weight dots named in `packed` (the runner's names: wqkv, wo, w_gate_up,
    w_down, lm_head) hold the int8 engine's values, q * scale per column and run of rows of each layer's 2-D
    view [K, N]: the fused views' columns are the checkpoint weights' columns side by side, so each quantises
    alike."""
    names = {part for name in packed for part in UNFUSED.get(name, (name,))}

    def dequantised(name, w):
        view = w.reshape(*w.shape[:-3], -1, w.shape[-1]) if name == "wo" else w.reshape(*w.shape[:2], -1) \
            if w.ndim > 2 else w
        return dequantize_int8(*quantize_int8(view)).reshape(w.shape)

    layers = {n: dequantised(n, w) if n in names else w for n, w in params["layers"].items()}
    out = dict(params, layers=layers)
    if "lm_head" in names:
        out["lm_head"] = dequantised("lm_head", params["lm_head"])
    return out


def test_int8_engine_equals_the_plain_forward_over_its_int8_values(tiny):
    """quantization="int8": the packed weight dots hold int8 values and their scales (per column and run of 32
    rows: about a quarter of the bytes), and the engine's greedy tokens over a mixed batch are the plain float32 forward's over those
    values (q * scale), token for token, as the float32 engine's are over the float32 weights; its log-probs
    are that forward's, not the float32 model's."""
    engine = make_engine(tiny, quantization="int8")
    layers = engine.runner.params["layers"]
    packed = {n for n, w in layers.items() if isinstance(w, PackedWeight)}
    assert packed == {"wo", "w_gate_up", "w_down"}  # gqa4: wqkv (N = 96) and lm_head (V = 260) stay float32
    for name in packed:  # [L, N / 64, K, 64] int8, scales [L, N / 64, K / 32, 64]
        data, scale = layers[name].data, layers[name].scale
        assert data.dtype == np.int8 and scale.shape == (*data.shape[:2], data.shape[2] // 32, 64)
    reference = int8_values(tiny.params, packed)
    prompts = mixed_prompts(16, seed=2)
    params = dataclasses.replace(GREEDY, logprobs=1)
    done = run_all(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        tokens = done[str(i)].outputs[0].token_ids
        assert tokens == greedy_generate(tiny.config, reference, prompt, GREEDY.max_tokens), f"prompt {i}"
        got = [lp[t].logprob for lp, t in zip(done[str(i)].outputs[0].logprobs, tokens)]
        ids = jnp.asarray([prompt + tokens[:-1]])
        for weights, close in ((reference, True), (tiny.params, False)):
            logits = forward_jit(tiny.config, weights, ids)[0, len(prompt) - 1:]
            want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)), np.asarray(tokens)[:, None], 1)
            assert np.allclose(got, want[:, 0], atol=1e-4) == close, (i, close)


def quantised_x_dot(x, data, layer, scale, rows):
    """A weight dot as quantization="w8a8" computes it: x's values per row and run of 32 (`quantize_rows_int8`)
    times their scales, @ the weight's int8 values times theirs (data)."""
    xq, d = quantize_rows_int8(x, 32)
    return (xq.astype(jnp.float32) * jnp.repeat(d, 32, axis=1)[:, :x.shape[1]]) @ data


def w8a8_values(params, packed: set[str]):
    """int8_values' params with the dots named in `packed` (of wo, w_gate_up, w_down) quantising their x first
    (`quantised_x_dot`, PackedWeights the plain forward calls; w_gate and w_up fused as the runner fuses them)."""
    layers = dict(int8_values(params, packed)["layers"])
    wo = layers["wo"]
    views = {"wo": wo.reshape(wo.shape[0], -1, wo.shape[-1]), "w_down": layers["w_down"]}
    if "w_gate_up" in packed:
        views["w_gate_up"] = jnp.concatenate([layers.pop("w_gate"), layers.pop("w_up")], axis=-1)
    for name in packed:
        view = views[name]  # [L, K, N]
        shape = (view.shape[1], 2, view.shape[2] // 2) if name == "w_gate_up" else view.shape[1:]
        layers[name] = PackedWeight(view, tuple(shape), quantised_x_dot)
    return dict(params, layers=layers)


def test_w8a8_engine_equals_the_plain_forward_with_its_x_quantised(tiny):
    """quantization="w8a8": the same int8 blocks as "int8", and the engine's greedy tokens over a mixed batch are
    the plain forward's over those values with each packed dot's x quantised per row and run of 32 values, token
    for token; its log-probs are that forward's, not the weight-only forward's (nor the float32 model's). x's
    values are rounded: the step's kernels leave x ~1e-6 from the plain forward's, which now and then rounds a
    value one step apart (1.4e-4 in a log-prob the most seen; the weight-only forward's nearest, 4.9e-4)."""
    engine = make_engine(tiny, quantization="w8a8")
    layers = engine.runner.params["layers"]
    packed = {n for n, w in layers.items() if isinstance(w, PackedWeight)}
    assert packed == {"wo", "w_gate_up", "w_down"}
    assert all(layers[n].data.dtype == np.int8 for n in packed)
    reference = w8a8_values(tiny.params, packed)
    prompts = mixed_prompts(16, seed=2)
    done = run_all(engine, prompts, dataclasses.replace(GREEDY, logprobs=1))
    for i, prompt in enumerate(prompts):
        tokens = done[str(i)].outputs[0].token_ids
        assert tokens == greedy_generate(tiny.config, reference, prompt, GREEDY.max_tokens), f"prompt {i}"
        got = [lp[t].logprob for lp, t in zip(done[str(i)].outputs[0].logprobs, tokens)]
        ids = jnp.asarray([prompt + tokens[:-1]])
        for weights, close in ((reference, True), (int8_values(tiny.params, packed), False), (tiny.params, False)):
            logits = forward_jit(tiny.config, weights, ids)[0, len(prompt) - 1:]
            want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)), np.asarray(tokens)[:, None], 1)
            assert np.allclose(got, want[:, 0], atol=2.5e-4) == close, (i, close)


def test_int8_needs_the_native_cpu_matmul_and_a_known_name(tiny):
    for quantization in ("int8", "w8a8"):
        with pytest.raises(ValueError, match="native CPU matmul"):
            make_engine(tiny, quantization=quantization, attention_backend="xla")
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineArgs(model="unused", quantization="int4")
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineArgs(model="unused", quantization="int8", tensor_parallel_size=2)


@pytest.mark.parametrize("quantization", [None, "int8", "w8a8", "fp8"])
def test_no_compilation_after_warmup(tiny, quantization):
    engine = make_engine(tiny, num_pages=40, quantization=quantization)  # small pool: preemption too
    prompts = mixed_prompts(20, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=5, logprobs=3), SamplingParams(repetition_penalty=1.3,
              presence_penalty=0.5, max_tokens=20), SamplingParams(n=2, temperature=1.0, stop=["a", "b"]),
              SamplingParams(min_tokens=4, max_tokens=6, logit_bias={3: 5.0})] * 4
    with count_traces() as traces:
        run_all(engine, prompts, params[:20])
    assert traces == []
    with count_traces() as traces:  # the counter does see a new shape
        jax.jit(lambda x: x + 1)(np.zeros(3))
    assert traces


def test_stop_string_token_and_eos(tiny):
    engine = make_engine(tiny)
    tok = tiny.tokenizer
    prompt = mixed_prompts(1, seed=5)[0]
    base = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))["0"]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    assert text == tok.decode(ids, skip_special_tokens=True)
    stop = tok.decode(ids[4:6])
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))["0"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and stop not in out.text
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[3]]))
    assert out["0"].outputs[0].token_ids == ids[:ids.index(ids[3]) + 1]
    assert out["0"].outputs[0].stop_reason == ids[3]
    # min_tokens bans the stop id until 6 tokens exist
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                                    stop_token_ids=[ids[0]]))["0"].outputs[0]
    assert len(out.token_ids) >= 6 and ids[0] not in out.token_ids[:5]


def test_eos_from_generation_config_stops(tiny):
    engine = make_engine(tiny)
    prompt = mixed_prompts(1, seed=6)[0]
    first = run_all(engine, [prompt], GREEDY)["0"].outputs[0].token_ids
    eos = first[2]
    loaded = dataclasses.replace(tiny, generation_config=dataclasses.replace(tiny.generation_config,
                                                                              eos_token_ids=(eos,)))
    engine = make_engine(loaded)
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12))["0"].outputs[0]
    assert out.token_ids == first[:first.index(eos) + 1] and out.finish_reason == "stop"
    ignored = run_all(engine, [prompt], GREEDY)["0"].outputs[0]
    assert ignored.token_ids == first


def test_rejections_are_clear_and_leave_nothing(tiny):
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("big", {"prompt_token_ids": list(range(100))}, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", {"prompt_token_ids": [1, 2, 99999]})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []})
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages


def test_abort_frees_everything(tiny):
    engine = make_engine(tiny)
    for i, prompt in enumerate(mixed_prompts(6, seed=8)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(n=2, max_tokens=20))
    engine.step()
    engine.step()
    engine.abort_request([str(i) for i in range(6)])
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    engine.scheduler.check_invariants()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_page_accounting_under_random_workloads(tiny, data):
    engine = make_engine(tiny, num_pages=data.draw(st.integers(12, 40)), max_num_seqs=4)
    num = data.draw(st.integers(1, 8))
    for i in range(num):
        prompt = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=60))
        params = SamplingParams(n=data.draw(st.integers(1, 3)), temperature=1.0, seed=i,
                                max_tokens=data.draw(st.integers(1, 20)))
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    abort_at = {str(i): data.draw(st.integers(0, 30)) for i in range(num) if data.draw(st.booleans())}
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.abort_request([rid for rid, at in abort_at.items() if at == step])
        engine.step()
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages
    assert all(pool.ref_count(p) == 0 for p in range(1, pool.num_pages))


@pytest.mark.parametrize("bad, param", [
    (dict(logit_bias={99999: 5.0}), "logit_bias"),
    (dict(stop_token_ids=[7, 260]), "stop_token_ids"),  # the tiny vocabulary is 260
    (dict(logit_bias={t: 1.0 for t in range(250)}, stop_token_ids=list(range(80)), min_tokens=2),
     "stop_token_ids"),  # more biased + banned ids than the sampler has room for
])
def test_invalid_request_fails_alone_before_any_step(tiny, bad, param):
    """A request the sampler could not serve is refused at add_request, naming the parameter; requests
    queued before and after it run as if it never came (no step fails for them)."""
    engine = make_engine(tiny)
    steps = []
    execute = engine.runner.execute_model
    engine.runner.execute_model = lambda out, *rest: steps.append(out) or execute(out, *rest)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    engine.add_request("before", {"prompt_token_ids": prompts[0]}, GREEDY)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, **bad))
    assert err.value.param == param and not steps
    assert engine.scheduler.get_request("bad") is None
    engine.add_request("after", {"prompt_token_ids": prompts[1]}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(done) == ["after", "before"]
    for rid, prompt in zip(("before", "after"), prompts):
        assert done[rid].outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, prompt, 12)
        assert done[rid].outputs[0].finish_reason == "length"


def test_request_running_and_prefix_cache_reset(tiny):
    """What AsyncLLM asks after a failed step, without reaching into the scheduler or the child ids."""
    engine = make_engine(tiny)
    engine.add_request("r", {"prompt_token_ids": list(range(40))}, SamplingParams(n=2, max_tokens=3,
                                                                                  ignore_eos=True))
    assert not engine.is_request_running("r") and not engine.is_request_running("unknown")
    engine.step()
    assert engine.is_request_running("r")
    assert not engine.reset_prefix_cache()  # pages held: nothing is reset
    assert engine.scheduler.pool.num_cached_pages > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.is_request_running("r")
    assert engine.reset_prefix_cache() and engine.scheduler.pool.num_cached_pages == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_first_scheduled_time_is_the_first_steps_and_stays(tiny, async_scheduling):
    """A request's first scheduling time is stamped by its first step (an entry sent whole) and no later step moves
    it; the n children of one prompt share their parent's."""
    engine = make_engine(tiny, async_scheduling=async_scheduling)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, dataclasses.replace(GREEDY, max_tokens=6))
    engine.add_request("b", {"prompt_token_ids": [8, 9]}, dataclasses.replace(GREEDY, max_tokens=4, n=2))
    metrics = {rid: engine._parents[rid].metrics for rid in "ab"}
    assert all(m.first_scheduled_time is None for m in metrics.values())
    engine.step()
    first = {rid: m.first_scheduled_time for rid, m in metrics.items()}
    assert all(t is not None and t >= metrics[rid].arrival_time for rid, t in first.items())
    while engine.has_unfinished_requests():
        engine.step()
    assert {rid: m.first_scheduled_time for rid, m in metrics.items()} == first
    assert all(m.first_token_time >= first[rid] for rid, m in metrics.items())
