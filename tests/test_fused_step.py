"""The fused step (RunnerConfig.fuse_sampler / EngineArgs.fuse_sampler / --fuse-sampler): the forward and the
sampler in one jitted program, one executable call per step.

The unfused engine (forward program, then the sampler's separate programs) is the reference: the fused one,
synchronous and overlapped (async scheduling), must emit the same tokens, text, logprobs and finishes for the
same seeds (greedy, seeded top-p / top-k / min-p, penalties, logit_bias, logprobs, prompt logprobs, n > 1,
stops, structured outputs, speculative decoding with packed and unpacked drafts), compile nothing after
warm-up, and dispatch one program per step when no fallback is needed. The HLO tests show the sampler inside
the step's program, compiled for this CPU and lowered for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import numpy as np
import pytest

from jaxpaged.sample import in_step
from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.spec_decode.verify import DraftRows
from jaxpaged.worker.step_input import empty_step
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.runner_config import FUSE_SAMPLER, RunnerConfig
from jaxpaged.worker.dispatch_count import count_dispatches
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import SamplingParams
from pallas_kernels import cuda_compile
from tests.test_async_scheduling import ABORTS, BASE, compiles_while, mix, run, summary, workload
from tests.test_engine import mixed_prompts
from tests.test_spec_decode import OracleProposer, repetitive_prompts, run_all, tokens
from tests.test_weight_layout import SMALL, entry, runner_config, small_params  # noqa: F401  (a fixture)
from jaxpaged.models.params import WeightLayout

# every proposed draft verified (no adaptive draft length, whose cuts follow this machine's step times)
SPEC3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive_draft_length": False}


@pytest.fixture(autouse=True)
def _drop_programs_after_each_test():
    """Each test builds engines that compile every step shape twice (fused programs): drop them after each
    test, not only after the module (conftest), or the executables' memory mappings reach the kernel's
    vm.max_map_count within this module and LLVM's JIT aborts."""
    yield
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


def make_engine(loaded, fuse: str, async_scheduling: bool = False, **overrides) -> LLMEngine:
    args = dataclasses.replace(BASE, fuse_sampler=fuse, async_scheduling=async_scheduling, **overrides)
    engine = LLMEngine(args, loaded=loaded)
    assert engine.runner.fuse_sampler is (fuse == "on") and engine.async_scheduling is async_scheduling
    return engine


def assert_same(results: dict, reference: dict, requests: dict) -> None:
    """Outputs equal the reference's (an aborted n > 1 request: each sample's common prefix, as the point
    where the other sample stops depends on when the abort lands)."""
    assert results.keys() == reference.keys() == requests.keys()
    for rid in requests:
        if rid in ABORTS and requests[rid][1].n > 1:
            for a, b in zip(results[rid].outputs, reference[rid].outputs):
                n = min(len(a.token_ids), len(b.token_ids))
                assert a.token_ids[:n] == b.token_ids[:n], rid
            continue
        assert summary(results[rid]) == summary(reference[rid]), rid


# ---- the switch ---------------------------------------------------------------------------------------------


def test_the_switch_is_validated_and_reaches_the_runner(tiny):
    assert FUSE_SAMPLER == ("auto", "on", "off") and RunnerConfig.fuse_sampler == EngineArgs.fuse_sampler == "auto"
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=16, num_pages=8)
    assert config.sampler_fused("gpu") and not config.sampler_fused("cpu")  # auto: docs/performance.md
    assert dataclasses.replace(config, fuse_sampler="on").sampler_fused("cpu")
    assert not dataclasses.replace(config, fuse_sampler="off").sampler_fused("gpu")
    for bad in ("yes", True, None):
        with pytest.raises(ValueError, match="fuse_sampler"):
            dataclasses.replace(config, fuse_sampler=bad)
        with pytest.raises(ValueError, match="fuse_sampler"):
            EngineArgs(model="unused", fuse_sampler=bad)
    with pytest.raises(ValueError, match="fuse_sampler='on' is not supported with tensor parallelism"):
        EngineArgs(model="unused", fuse_sampler="on", tensor_parallel_size=2)
    assert make_engine(tiny, "auto").runner.fuse_sampler is (jax.default_backend() == "gpu")


def test_cli_flag_reaches_the_engine_args():
    from server.__main__ import build_parser, engine_args
    parser = build_parser()
    assert engine_args(parser.parse_args(["--fuse-sampler", "on"])).fuse_sampler == "on"
    assert engine_args(parser.parse_args(["--fuse-sampler", "off"])).fuse_sampler == "off"
    assert engine_args(parser.parse_args([])).fuse_sampler == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--fuse-sampler", "maybe"])


def test_a_mesh_refuses_the_fused_sampler(small_params):  # noqa: F811
    """A tensor-parallel mesh samples on the host's replicated logits: "on" is a clear error, "auto" is off."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    layout = WeightLayout(fused=True)
    with pytest.raises(ValueError, match="fuse_sampler='on' needs one device"):
        ModelRunner(SMALL, small_params, runner_config(layout, fuse_sampler="on"), mesh=mesh)
    assert not ModelRunner(SMALL, small_params, runner_config(layout), mesh=mesh).fuse_sampler


# ---- same outputs as the unfused engine ---------------------------------------------------------------------


@pytest.mark.parametrize("config", ["cache", "preempt", "chunked"])
def test_fused_equals_unfused(tiny, config):
    """The mixed workload (greedy, seeded top-p / top-k, penalties, logprobs, prompt logprobs, n > 1,
    min_tokens, logit_bias, stop strings and ids, aborts), synchronous and overlapped: the unfused
    synchronous engine's outputs. Random rows of this tiny model's flat distributions take the native
    whole-row pass (temperature alone) and the full-vocabulary fallback (top_p 0.999: mass past the 256
    candidates) too."""
    overrides = {"cache": {}, "preempt": dict(num_pages=24), "chunked": dict(max_num_batched_tokens=16,
                                                                             max_num_seqs=8)}[config]
    requests = workload(tiny)
    reference = run(make_engine(tiny, "off", **overrides), requests, ABORTS)
    for async_scheduling in (False, True):
        engine = make_engine(tiny, "on", async_scheduling, **overrides)
        with count_dispatches(engine.runner) as counts:
            results = run(engine, requests, ABORTS)
        assert counts["fused_step"] > 0 and counts["paged_forward"] == 0
        assert counts["_resample_rows"] > 0  # the fallbacks ran, and still the same samples
        assert_same(results, reference, requests)
        if config == "preempt":
            assert engine.scheduler.num_preemptions > 0


def test_structured_outputs_and_penalties(tiny):
    """Grammar masks in the fused program (synchronous) and beside it (overlapped: a constrained row's mask
    needs the previous step's token on the host), with penalties and logprobs: the unfused outputs."""
    pytest.importorskip("llguidance")
    from tests.test_async_scheduling import constrained_params
    params = constrained_params() + [
        SamplingParams(temperature=0.9, seed=4, max_tokens=30, repetition_penalty=1.2, presence_penalty=0.4,
                       frequency_penalty=0.3, min_p=0.05),
        SamplingParams(temperature=0.0, max_tokens=12, logit_bias={65: 3.0})]
    requests = {f"r{i}": ([1, 2, 3, 4, 5, i], p) for i, p in enumerate(params)}
    small = dict(max_num_seqs=8, max_num_batched_tokens=32)
    reference = run(make_engine(tiny, "off", **small), requests)
    for async_scheduling in (False, True):
        assert_same(run(make_engine(tiny, "on", async_scheduling, **small), requests), reference, requests)
    assert reference["r0"].outputs[0].finish_reason == "stop"


def test_penalties_count_the_token_in_flight(tiny):
    """Overlapped, the fused step's rows are built before the previous step's token reaches the host: the
    program counts that token (fed as a placeholder) itself. Strong penalties on greedy rows, where the
    token just emitted decides the next argmax: the synchronous unfused outputs."""
    strong = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(presence_penalty=2.0, **strong), SamplingParams(frequency_penalty=2.0, **strong),
              SamplingParams(repetition_penalty=3.0, **strong),
              SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, presence_penalty=2.0)]
    requests = {str(i): (p, params[i % 4]) for i, p in enumerate(mixed_prompts(8, seed=21))}
    reference = run(make_engine(tiny, "off"), requests)
    plain = {rid: (p, dataclasses.replace(sp, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
             for rid, (p, sp) in requests.items()}
    unpenalised = run(make_engine(tiny, "off"), plain)
    assert any(summary(unpenalised[rid]) != summary(reference[rid]) for rid in requests)  # the penalties bite
    assert_same(run(make_engine(tiny, "on", True), requests), reference, requests)


@pytest.mark.parametrize("batch", ["packed", "unpacked"])
def test_speculative_decoding(tiny, batch, monkeypatch):
    """Drafts verified in the fused program (packed into the padding rows: one request at a time, k = 3) or
    beside it (a batch: draft_logits and a sampler call): the unfused engine's tokens and acceptance counts,
    drafts accepted and rejected. The fused engine's candidate pass keeps 8 candidates a row (any number
    gives the same samples), so random rows often take the fallbacks, which may change a draft row's
    token: the program's acceptance count is then recomputed."""
    monkeypatch.setattr(in_step, "sample_in_step", functools.partial(in_step.sample_in_step, prefilter_k=8))
    prompts = repetitive_prompts(4 if batch == "packed" else 8, seed=5)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, max_tokens=24, ignore_eos=True,
                             repetition_penalty=r, logprobs=lp)
              for s, (t, p, k, r, lp) in enumerate([(0.0, 1.0, -1, 1.0, None), (0.8, 0.9, -1, 1.0, 2),
                                                    (1.0, 1.0, -1, 1.2, None), (0.0, 1.0, -1, 1.3, 1)] * 2)]
    groups = [[i] for i in range(len(prompts))] if batch == "packed" else [list(range(len(prompts)))]
    outputs, stats = {}, {}
    for fuse in ("off", "on"):
        # 8 slots for the batch's 8 verifications: every decode's drafts fit, so all verify (Scheduler._draft_room)
        engine = make_engine(tiny, fuse, speculative_config=SPEC3, max_num_partial_prefills=8)
        with count_dispatches(engine.runner) as counts:
            for oracle in (False, True):
                if oracle:  # drafts accepted, then rejected from the second on
                    reference = [outputs["off", False][i] for i in range(len(prompts))]
                    engine.proposer = OracleProposer(prompts, reference, k=3, wrong_at=1)
                for group in groups:
                    done = tokens(run_all(engine, [prompts[i] for i in group], [params[i] for i in group]))
                    outputs.setdefault((fuse, oracle), {}).update({i: done[str(j)][0] for j, i in enumerate(group)})
        stats[fuse] = {k: v for k, v in engine.stats().items() if k.startswith("spec_decode")}
        assert 0 < stats[fuse]["spec_decode_num_accepted_tokens"] < stats[fuse]["spec_decode_num_draft_tokens"]
        if fuse == "on":
            assert counts["_resample_rows"] > 0 and counts["fused_step"] > 0
            assert (counts["draft_logits"] == 0) is (batch == "packed")
    assert outputs["on", False] == outputs["off", False] and outputs["on", True] == outputs["off", True]
    assert stats["on"] == stats["off"]


@pytest.mark.parametrize("batch", ["packed", "unpacked"])
def test_speculative_decoding_with_structured_outputs(tiny, batch):
    """Constrained requests speculating (the grammar's forced tokens and n-gram drafts, a mask per verified
    position) with the sampler in the step program: drafts in its padding rows (one request at a time) or in
    draft_logits (a batch); tokens, text, finish and logprobs those of the unfused engine without speculation."""
    pytest.importorskip("llguidance")
    from tests.test_async_scheduling import constrained_params
    params = [dataclasses.replace(p, n=1) if batch == "packed" else p for p in constrained_params()]  # 1 sequence
    requests = {f"r{i}": ([1, 2, 3, 4, 5, i], p) for i, p in enumerate(params)}
    groups = [{rid: r} for rid, r in requests.items()] if batch == "packed" else [requests]
    small = dict(max_num_seqs=8, max_num_batched_tokens=32, max_num_partial_prefills=8)
    reference = run(make_engine(tiny, "off", **small), requests)
    engine = make_engine(tiny, "on", speculative_config=SPEC3, **small)
    with count_dispatches(engine.runner) as counts:
        results = {rid: out for group in groups for rid, out in run(engine, group).items()}
    assert_same(results, reference, requests)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0 and counts["fused_step"] > 0
    assert (counts["draft_logits"] == 0) is (batch == "packed")


def test_smollm2_fused_equals_unfused(smollm2):
    """The real vocabulary (49,152 ids: the candidate pass decides random rows): greedy, seeded top-p 0.95,
    top-k with logprobs, n > 1 and a stop string, synchronous and overlapped."""
    prompts = [list(smollm2.tokenizer(text)["input_ids"]) for text in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, there was a", "1, 2, 3,")]
    params = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.7, top_p=0.95, seed=5,
              max_tokens=16), SamplingParams(temperature=1.0, top_k=40, seed=2, logprobs=3, max_tokens=12, stop=[","]),
              SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, min_p=0.1)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    overrides = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_pages=64)
    reference = run(make_engine(smollm2, "off", **overrides), requests)
    for async_scheduling in (False, True):
        assert_same(run(make_engine(smollm2, "on", async_scheduling, **overrides), requests), reference, requests)


# ---- compiles and dispatches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async", "spec"])
def test_no_compilation_after_warmup(tiny, mode):
    """Warm-up compiles two fused programs per (T, S, P) bucket (greedy-only, random rows; no forward-only
    program) and every sampler part; the mixed workload (fallbacks, logprobs, penalties, preemption) then
    compiles nothing."""
    extra = {"async": dict(async_scheduling=True), "spec": dict(speculative_config=SPEC3)}.get(mode, {})
    engine = make_engine(tiny, "on", num_pages=40, warmup=True, **extra)
    runner = engine.runner
    assert len(runner._compiled_fused) == 2 * len(runner.config.buckets) and not runner._compiled
    prompts = mixed_prompts(20, seed=4) + (repetitive_prompts(6, seed=4) if mode == "spec" else [])
    requests = {str(i): (p, mix(i)) for i, p in enumerate(prompts)}
    traces, compiles = compiles_while(lambda: run(engine, requests, {"1": 2, "4": 1}))
    assert traces == [] and compiles == []
    if mode == "spec":
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    else:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_program_per_step(tiny, async_scheduling):
    """A fused step is one executable call when no fallback is needed (greedy and top-k rows, penalties,
    logit_bias; no logprobs): the placeholder gather (async), the forward, the sampler. The unfused engine
    makes two or three calls per step."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=8, seed=3, max_tokens=8, logit_bias={7: 2.0}),
              SamplingParams(temperature=0.7, top_k=3, seed=4, max_tokens=9, repetition_penalty=1.2)]
    prompts = mixed_prompts(6, seed=8)
    per_step = {}
    for fuse in ("off", "on"):
        engine = make_engine(tiny, fuse, async_scheduling, warmup=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params[i % 3])
        per_step[fuse] = []
        while engine.has_unfinished_requests():
            with count_dispatches(engine.runner) as counts:
                engine.step()
            per_step[fuse].append(dict(counts))
    steps = [c for c in per_step["on"] if c]
    assert steps and all(c == {"fused_step": 1} for c in steps), per_step["on"]
    assert len(steps) >= len(per_step["on"]) - 1  # async: the last call only hands the last step's tokens back
    assert all(sum(c.values()) >= 2 for c in per_step["off"] if c)


def test_a_fused_steps_inputs_are_each_of_one_kind(tiny):
    """A fused step without a logit bias, packed drafts or positions moved back sends none: the device's neutral
    arrays stand in. A step with them puts them on the device too, so each input is always of one kind (a numpy
    array where a device array was would be another entry in the fused step's jit cache: a compile)."""
    runner = make_engine(tiny, "on", speculative_config=SPEC3).runner
    T, S, P = runner.config.buckets[0]
    step, V = empty_step(T, S, P), tiny.config.vocab_size
    plain = dataclasses.replace(make_sampling_batch([RowInfo(SamplingParams(), seed=0)], S, V), bias_ids=None,
                                bias_values=None)  # assemble_sampling_batch(neutral_bias=True)'s, no row biased
    biased = make_sampling_batch([RowInfo(SamplingParams(logit_bias={3: 1.0}), seed=0)], S, V)
    lean = runner._step_sampling(plain, step)
    assert lean.bias_ids is runner._neutral[S][3] and lean.shifts is runner._no_shifts[T]
    assert lean.draft_rows is runner._no_drafts[S][0]
    layout = DraftRows(True, ("a",), (2,), np.array([[1, 2, 0]], np.int32), np.array([[5, 6, -1]], np.int32),
                       np.array([0, 0], np.int32), ())
    full = runner._step_sampling(biased, step, shifts=np.zeros(T, np.int32), layout=layout)
    assert np.asarray(full.bias_values)[0, 0] == 1.0 and np.asarray(full.draft_ids)[0].tolist() == [5, 6, -1]

    def kinds(batch):
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        return treedef, [(type(x) is np.ndarray, np.shape(x), np.result_type(x)) for x in leaves]
    assert kinds(lean) == kinds(full)


@pytest.mark.parametrize("k", [3, 7])
def test_packed_drafts_are_verified_in_the_step_program(tiny, k):
    """One request with drafts packed into the padding rows: its verification steps are one call too. 7 drafts
    overflow its S bucket's rows (4 slots): the step takes the next S bucket (16) rather than a second pass over
    the LM head and a sampler call of their own."""
    prompt = repetitive_prompts(1, seed=6)[0]
    engine = make_engine(tiny, "on", speculative_config={**SPEC3, "num_speculative_tokens": k}, warmup=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy)
    drafted = 0
    while engine.has_unfinished_requests():
        drafts = engine.stats()["spec_decode_num_draft_tokens"]
        with count_dispatches(engine.runner) as counts:
            engine.step()
        assert dict(counts) == {"fused_step": 1}
        drafted += engine.stats()["spec_decode_num_draft_tokens"] - drafts >= min(k, 4)  # k = 7: past S = 4
    assert drafted > 0 and engine.stats()["spec_decode_num_accepted_tokens"] > 0


# ---- HLO evidence: the sampler is inside the step's program ---------------------------------------------------


def fused_runner(params, **fields) -> tuple[ModelRunner, object]:
    runner = ModelRunner(SMALL, params, runner_config(WeightLayout(per_layer=True, fused=True), fuse_sampler="on",
                                                      **fields))
    return runner, runner.prepare([entry("a", [11], 40, [3, 7, 9])])  # one decode token


def entry_result(text: str) -> str:
    """The result type of a compiled HLO module's entry computation."""
    return next(line for line in text.splitlines() if line.startswith("ENTRY")).split("->")[-1]


def test_compiled_cpu_step_holds_the_sampler(small_params):  # noqa: F811
    """The compiled fused programs (this CPU) compute the LM head and sample in the same program: their result
    holds the sampled ids i32[S] beside the logits, their body the finite-logits check; the one with random
    rows holds the Gumbel noise's threefry (its xor rounds). The forward-only program holds none of it."""
    runner, step = fused_runner(small_params)
    S, V = step.page_table.shape[0], SMALL.vocab_size
    random = runner.lower_fused(step, random=True).compile().as_text()
    greedy = runner.lower_fused(step, random=False).compile().as_text()
    plain = runner.lower(step).compile().as_text()
    for text in (random, greedy):
        assert f"s32[{S}]" in entry_result(text) and f"f32[{S},{V}]" in entry_result(text)
        assert " is-finite(" in text
    assert f"s32[{S}]" not in entry_result(plain) and " is-finite(" not in plain
    assert " xor(" in random and " xor(" not in greedy and " xor(" not in plain
    assert " conditional(" not in random + greedy


def test_cuda_lowering_holds_the_sampler(small_params):  # noqa: F811
    """The fused step lowered for CUDA from this CPU (the Pallas attention kernel as on a GPU): one module with
    the kernel, the LM head and the sampler (the candidate top-k, threefry's xor rounds, the finite check),
    no conditional; the forward-only lowering has none of the sampler."""
    runner, step = fused_runner(small_params, attention_backend="pallas")
    with cuda_compile.gpu_target():
        fused = runner.lower_fused(step, random=True, platforms=("cuda",)).as_text()
        plain = runner.lower(step, platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in fused and "__gpu$xla.gpu.triton" in plain
    for marker in ("chlo.top_k", "stablehlo.xor", "stablehlo.is_finite"):
        assert marker in fused and marker not in plain, marker
    assert "stablehlo.case" not in fused and "stablehlo.if" not in fused


def test_a_step_after_random_rows_builds_its_sampler_inputs_before_reading_their_flags(tiny, monkeypatch):
    """Overlapped, a step after one with random rows waits for that step's forward (its sampler's flags say
    whether a row needs the fallback) only once its own sampler inputs are built, so that host work overlaps
    the device's: each step's build comes before the previous step's flags are read, not after."""
    engine = make_engine(tiny, "on", True)
    events = []
    build, finish_random = engine.runner._sampling_batch, in_step._finish_random
    monkeypatch.setattr(engine.runner, "_sampling_batch", lambda *a, **k: events.append("build") or build(*a, **k))
    monkeypatch.setattr(in_step, "_finish_random", lambda *a: events.append("flags") or finish_random(*a))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    # step 1 built; step 2 built, then step 1's flags read (dispatching 2 after them); ...; the last step's flags
    assert events == ["build"] + ["build", "flags"] * 5 + ["flags"]
