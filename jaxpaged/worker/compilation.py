"""Compiling a runner's step programs: lowering each bucket's programs, compiling them in parallel at warm-up
(or loading them from the persistent cache), and the compiled programs a step runs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.llama import Params
from jaxpaged.sample import sampler
from jaxpaged.sample.sampling_batch import make_sampling_batch
from jaxpaged.spec_decode.verify import accept_drafts, redraft_in_flight
from jaxpaged.worker import parallel
from jaxpaged.worker.compile_progress import CompileProgress
from jaxpaged.worker.host_memory import advise_huge_pages
from jaxpaged.worker.in_flight import carry_tokens, fill_in_flight_jit, merge_sampled_tokens
from jaxpaged.worker.runner_config import _MAX_COMPILE_THREADS, _WARMUP_BARRIER_SECONDS
from jaxpaged.sample.sampling_batch import SamplingBatch
from jaxpaged.worker.step_input import (HostLayout, StepInput, empty_step, has_random_rows, pack_host_inputs,
                                       pad_sampled_tokens)
from jaxpaged.worker.step_program import FusedSample, draft_logits, prompt_logprobs_step

logger = logging.getLogger(__name__)


class StepCompilation:
    """ModelRunner's methods for compiling its programs: they share its state (see ModelRunner.__init__)."""

    def lower(self, step: StepInput, params: Params | None = None,
              platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The jitted step lowered at `step`'s shapes (and `params`' layout, by default the runner's),
        to read its HLO or compile it with XLA options (`.compile(compiler_options={...})`). The
        compiled program takes (params, kv, step), donates kv and returns (logits, hidden, kv).
        platforms: lower for those instead of this machine's (e.g. ("cuda",) on a CPU: StableHLO only)."""
        args = (self.model_config, self.config.attention, self.params if params is None else params,
                self.kv, step) + (() if self.mesh is None else (self.mesh,))
        if platforms is None:
            return self._step.lower(*args)
        return self._step.trace(*args).lower(lowering_platforms=platforms)

    def lower_fused(self, step: StepInput, random: bool = True,
                    platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The fused step (`fused_step`: forward, sampler, draft acceptance) lowered at `step`'s shapes, its
        greedy-only program or (random) the one with random rows; the compiled program takes
        (params, kv, buffer, others): `pack_host_inputs((step, SamplingBatch))`, of `neutral_sampling`'s kind
        (`fused_program_args`), and returns ((sample, num_accepted, next_tokens), hidden, kv). platforms: as in
        `lower`."""
        return self._lower_packed(random, self._neutral_packed(step), platforms)

    def _lower_packed(self, random: bool, packed: tuple[HostLayout, np.ndarray, list],
                      platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """`lower_fused` of a step's inputs already packed (`pack_host_inputs`: layout, buffer, others)."""
        args = (self.model_config, self.config.attention, random, packed[0], self.params, self.kv, *packed[1:])
        if platforms is None:
            return self._fused_step.lower(*args)
        return self._fused_step.trace(*args).lower(lowering_platforms=platforms)

    def _neutral_packed(self, step: StepInput) -> tuple[HostLayout, np.ndarray, list]:
        """`pack_host_inputs` of `step` with `neutral_sampling(step)`: what warm-up compiles the fused step for."""
        return pack_host_inputs((step, self.neutral_sampling(step)))

    def fused_program_args(self, step: StepInput) -> tuple:
        """The arguments after (params, kv) of the fused program `step_program(step)` for a greedy step."""
        return self._neutral_packed(step)[1:]

    def neutral_sampling(self, step: StepInput) -> SamplingBatch:
        """A fused step's sampler inputs at `step`'s shape with greedy padding rows only (lowering, benches)."""
        batch = make_sampling_batch([], len(step.logits_indices), self.model_config.vocab_size)
        return self._step_sampling(batch, step)

    def compiled_fused_program(self, step: StepInput, random: bool) -> jax.stages.Compiled | None:
        """The fused program `warmup` compiled for `step`'s (T, S, P) shape, greedy-only or with random rows
        (None before warm-up or when the sampler is not fused)."""
        return self._compiled_fused.get(_fused_key(step, random))

    def step_program(self, step: StepInput) -> jax.stages.Compiled | None:
        """The program a greedy step of `step`'s shape runs: the fused one (called with (params, kv,
        *`fused_program_args(step)`)) when the sampler is fused, else the forward (params, kv, step)."""
        return self.compiled_fused_program(step, False) if self.fuse_sampler else self.compiled_program(step)

    def compiled_program(self, step: StepInput) -> jax.stages.Compiled | None:
        """The program `warmup` compiled for `step`'s (T, S, P, L) shape (None before warm-up): to read its HLO
        or to call it as `execute` does, (params, kv, step) -> (logits, hidden, kv), kv donated."""
        return self._compiled.get((len(step.token_ids), *step.page_table.shape, len(step.logits_indices)))

    def forget_compiled(self) -> None:
        """Drop the warm programs (a later `warmup` compiles or loads them again)."""
        self._compiled.clear()
        self._compiled_fused.clear()
        self._fused_layouts.clear()

    def _run(self, step: StepInput) -> tuple[jax.Array, jax.Array]:
        """(logits, hidden) from the step's program compiled by `warmup` (else the jitted step, compiling
        on first use)."""
        compiled, mesh = self.compiled_program(step), () if self.mesh is None else (self.mesh,)
        if mesh:
            rep = parallel.replicated(self.mesh)
            step = jax.tree.map(lambda x: parallel.put_global(x, rep), step)
        if compiled is not None:
            logits, hidden, self.kv = compiled(self.params, self.kv, step)
        else:
            logits, hidden, self.kv = self._step(self.model_config, self.config.attention, self.params, self.kv,
                                                 step, *mesh)
        if not mesh:
            return logits, hidden
        # replicated: this process's full copies, sampled locally
        return logits.addressable_data(0), hidden.addressable_data(0)

    def _run_fused(self, step: StepInput, sampling: SamplingBatch) -> tuple[FusedSample, jax.Array]:
        """((sample, num_accepted, next_tokens), hidden [T, E]) from the fused program `warmup` compiled for the
        step's shape and batch (greedy-only or not; else the jitted one, compiling on first use), its host arrays
        packed as that program's were (`pack_host_inputs`)."""
        random = has_random_rows(sampling)
        key = _fused_key(step, random)
        compiled, warm = self._compiled_fused.get(key), self._fused_layouts.get(key)
        layout, buffer, others = pack_host_inputs((step, sampling), warm)
        if compiled is not None and layout == warm:
            fused, hidden, self.kv = compiled(self.params, self.kv, buffer, others)
        else:  # (an input of another kind than warm-up's would be a new layout: compiled on first use)
            fused, hidden, self.kv = self._fused_step(self.model_config, self.config.attention, random, layout,
                                                      self.params, self.kv, buffer, others)
        return fused, hidden

    def warmup(self, async_scheduling: bool = False) -> dict[str, float]:
        """Compile every (T, S, P) bucket and the sampler ahead of time, so serving never compiles.

        With the fused sampler each shape gets the fused step's two programs, greedy-only and with random rows
        (the forward alone is never compiled: steps that sample outside it use the greedy program's logits).
        async_scheduling: also the placeholder-token gathers (`lower_async`). Nothing runs: this thread traces
        and lowers every program, a pool of threads compiles them as they come (XLA compiles outside the GIL;
        a persistent-cache hit loads the program instead) and fills the jit caches (the sampler's parts and
        the others called through their jits) or `_compiled` (the step shapes, which `_run` calls directly).
        Returns the wall seconds of its phases: {"sampler": lowering the sampler's, prompt-logprob and draft
        programs, "async": lowering the gathers (with async_scheduling), "compile": the rest (lowering the
        step shapes, then waiting for the pool)}. Logs each step shape when the pool has finished its programs
        (CompileProgress), so a cold start shows its true progress. Every process compiles the same programs.
        """
        start, buckets, phases = time.perf_counter(), self.config.buckets, {}
        # half the cores: XLA:CPU's compile of one program takes a second core (one thread: 34.4 s cold, two: 40.2)
        workers = max(1, min(len(buckets), (os.cpu_count() or 1) // 2, _MAX_COMPILE_THREADS))
        logger.info("compiling %d step shapes (T, S, P) and the sampler's programs on %d thread%s (or loading "
                    "them from the persistent compilation cache)", len(buckets), workers, "s" if workers > 1 else "")
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxpaged-compile") as pool, \
                CompileProgress(len(buckets), workers) as progress:
            futures = {}  # future -> (dict, key) its program goes to, None: a jit's cache holds it
            for t, s, p in buckets:
                options = self.config.compiler_options(num_tokens=t)
                for rows in self._warm_logits_rows((t, s, p)):
                    lowered = self.lower(empty_step(t, s, p, rows))
                    futures[progress.submit(pool, lowered, options, (t, s, p))] = (self._compiled, (t, s, p, rows))
                packed = self._neutral_packed(empty_step(t, s, p)) if self.fuse_sampler else None
                for random in (False, True) if self.fuse_sampler else ():
                    lowered = self._lower_packed(random, packed)
                    self._fused_layouts[(t, s, p, random)] = packed[0]
                    futures[progress.submit(pool, lowered, options, (t, s, p))] = \
                        (self._compiled_fused, (t, s, p, random))
            for phase, lower in (("sampler", self.lower_sampler), ("async", self.lower_async)):
                if phase == "async" and not async_scheduling:
                    continue
                phase_start = time.perf_counter()
                futures.update((progress.submit(pool, lowered, None, None), None) for lowered in lower())
                phases[phase] = time.perf_counter() - phase_start
            progress.wait()
            for future, target in futures.items():
                if target is not None:
                    target[0][target[1]] = future.result()
        phases["compile"] = time.perf_counter() - start - sum(phases.values())
        logger.info("compiled %d step shapes (T, S, P) and %d other programs: %s", len(buckets),
                    sum(target is None for target in futures.values()), progress.summary())
        if self.multi_process:  # processes finish compiling at different times: meet, then run a step together
            parallel.barrier("jaxpaged-warmup", _WARMUP_BARRIER_SECONDS)
            jax.block_until_ready(self._run(empty_step(*buckets[0])))  # also sets up the cross-process collectives
        if self._huge_pages is not None:  # the weights' advice done, then again: pages it could not collapse
            self._huge_pages.join()  # (already huge: free; the pool's pages come in huge as it fills)
            advise_huge_pages(self.params)
        return phases

    def _warm_logits_rows(self, shape: tuple[int, int, int]) -> tuple[int, ...]:
        """The L values `warmup` compiles the forward of shape (T, S, P) with (none with the fused sampler)."""
        if self.fuse_sampler:
            return ()
        t, s, _ = shape
        return (s, t) if shape in self._verify_buckets else (s,)

    def lower_sampler(self) -> list[jax.stages.Lowered]:
        """The sampler's parts at every S bucket (sampler.lower_parts) and, on one device (the engine refuses
        prompt log-probs on a mesh), the prompt log-probs' and speculative decoding's programs: what `warmup`
        compiles besides the step shapes and async scheduling's gathers."""
        V = self.model_config.vocab_size
        lowered = [program for s in self.config.seq_buckets for program in sampler.lower_parts(s, V)]
        return lowered + (self.lower_prompt_logprobs() + self.lower_draft_verification() if self.mesh is None else [])

    def lower_prompt_logprobs(self) -> list[jax.stages.Lowered]:
        """prompt_logprobs_step at every T bucket (it runs only for requests that ask)."""
        return [prompt_logprobs_step.lower(self.model_config, self.params,
                                           jnp.zeros((t, self.model_config.hidden_size), self.dtype),
                                           np.zeros(t, np.int32), batch_invariant=self.invariant_head)
                for t in sorted({t for t, _, _ in self.config.buckets})]

    def lower_draft_verification(self) -> list[jax.stages.Lowered]:
        """Speculative decoding: draft_logits at every (T, M) of `draft_shapes`, the sampler at every M x k rows
        and at the T rows of packed verify buckets, and accept_drafts for each (rows sampled, M) (none when
        speculation is off)."""
        k, V = self.config.num_speculative_tokens, self.model_config.vocab_size
        lowered = [draft_logits.lower(self.model_config, self.params,
                                      jnp.zeros((t, self.model_config.hidden_size), self.dtype),
                                      np.zeros(m * k, np.int32), batch_invariant=self.invariant_head)
                   for t, m in self.config.draft_shapes]
        packed = {t for t, _, _ in self._verify_buckets}  # T logits rows of the packed verify buckets
        for rows in sorted(packed - set(self.config.seq_buckets)):
            lowered += sampler.lower_parts(rows, V)
        for m in self.config.draft_seq_buckets:
            lowered += sampler.lower_parts(m * k, V)
            lowered += [accept_drafts.lower(jnp.zeros(n, jnp.int32), np.zeros((m, k), np.int32),
                                            np.zeros((m, k), np.int32))
                        for n in {m * k, *self.config.seq_buckets, *packed}]  # draft rows alone, or with the entries'
        return lowered

    def lower_async(self) -> list[jax.stages.Lowered]:
        """Async scheduling's gathers: `pad_sampled_tokens` at every S bucket (a step's sampled tokens as the next
        step's, i32[largest S]) and, unless the step program gathers them itself (the fused sampler),
        `merge_sampled_tokens` at every T bucket."""
        R = self.config.seq_buckets[-1]
        lowered = [pad_sampled_tokens.lower(jnp.zeros((s,), jnp.int32), R) for s in self.config.seq_buckets]
        if not self.fuse_sampler:
            lowered += [merge_sampled_tokens.lower(np.zeros(t, np.int32), jnp.zeros(R, jnp.int32),
                                                   np.full(t, -1, np.int32))
                        for t in sorted({t for t, _, _ in self.config.buckets})]
        return lowered + self.lower_verification_in_flight()

    def lower_verification_in_flight(self) -> list[jax.stages.Lowered]:
        """Speculative decoding under async scheduling: `carry_tokens` for each (rows sampled, draft rows, M) a
        verification step has, and, unless the step program does it itself (the fused sampler),
        `fill_in_flight_jit` at every (T, S, P) bucket (none when speculation is off)."""
        k, R = self.config.num_speculative_tokens, self.config.seq_buckets[-1]
        if not k:
            return []
        i32 = functools.partial(np.zeros, dtype=np.int32)
        packed = {t for t, _, _ in self._verify_buckets} | set(self.config.seq_buckets)
        slots = self.config.draft_seq_buckets
        # (rows sampled, draft rows, M, acceptance counts): packed (the fused step counts its S rows' slots, S >= M:
        # each slot takes two rows), or not
        shapes = {(n, n, m, a) for n in packed for m in slots for a in ({m, n} if self.fuse_sampler else {m})
                  if a >= m} | \
            {(s, m * k, m, m) for s in self.config.seq_buckets for m in slots}
        lowered = [carry_tokens.lower(jnp.zeros(n, jnp.int32), jnp.zeros(d, jnp.int32), R, i32(m), i32((m, k)),
                                      jnp.zeros(a, jnp.int32), i32(m), i32((m, k))) for n, d, m, a in sorted(shapes)]
        if not self.fuse_sampler:
            zeros, none = jnp.zeros(R, jnp.int32), functools.partial(np.full, fill_value=-1, dtype=np.int32)
            lowered += [fill_in_flight_jit.lower(i32(t), i32(t), i32(t), i32((s, p)), i32(s), i32(s + 1), zeros,
                                                 zeros, none(t), none(t), self._no_redraft, self.config.page_size)
                        for t, s, p in self.config.buckets]
        # drafts proposed on the device (prompt_lookup): at every (M, H); the layout's draft_ids on the host
        lookup, zeros = self.config.prompt_lookup, jnp.zeros(R, jnp.int32)
        lowered += [redraft_in_flight.lower(i32((m, k)), i32((m, h)), i32(m), i32(m), i32(m), zeros, zeros, i32(m),
                                            self._no_redraft, i32(m), self._redraft_slots, lookup)
                    for m in slots for h in self.config.history_buckets]
        return lowered


def _fused_key(step: StepInput, random: bool) -> tuple[int, int, int, bool]:
    """A fused program's key: the step's (T, S, P) shape and whether it has random rows."""
    return (len(step.token_ids), *step.page_table.shape, random)
