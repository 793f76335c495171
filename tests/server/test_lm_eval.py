"""lm-evaluation-harness as a real client: `lm_eval --model local-completions` against the running server
on the repo's local tasks (tests/evals/tasks: a multiple-choice loglikelihood task and a generate_until
task over one JSON file; no hub downloads). Its per-choice loglikelihoods equal the model's own (f32)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpaged.models import llama
from jaxpaged.models.loader import load_model
from tests.server.conftest import MODEL_NAME

TASKS = Path(__file__).parents[1] / "evals" / "tasks"
pytestmark = pytest.mark.slow


def run_lm_eval(live, tasks: str, out: Path) -> dict:
    pytest.importorskip("lm_eval")
    args = ",".join([f"model={MODEL_NAME}", f"base_url={live.v1}/completions", f"tokenizer={live.model_path}",
                     "tokenizer_backend=huggingface", "tokenized_requests=True", "num_concurrent=1",
                     "max_retries=1", "max_length=128"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
           "--tasks", tasks, "--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(results).read_text())


def samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's split (the context's tokens, then the rest of the whole's), scored by a plain f32 forward."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    logits = llama.forward(model.config, model.params, np.asarray([whole], np.int32))[0]
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return float(sum(logprobs[q - 1, whole[q]] for q in range(n_ctx, len(whole))))


def test_lm_eval_loglikelihood_and_generate_until(live, tmp_path):
    results = run_lm_eval(live, "jaxpaged_mc,jaxpaged_gen", tmp_path)
    assert set(results["results"]) == {"jaxpaged_mc", "jaxpaged_gen"}
    assert 0.0 <= results["results"]["jaxpaged_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["results"]["jaxpaged_gen"]
    model = load_model(live.model_path, dtype="float32")
    mc = samples(tmp_path, "jaxpaged_mc")
    assert len(mc) == 4 and sum(len(s["doc"]["choices"]) for s in mc) == 11
    compared = 0
    for sample in mc:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            compared += 1
            ll = float(resp[0][0])
            want = direct_loglikelihood(model, model.tokenizer, args["arg_0"], args["arg_1"])
            assert ll == pytest.approx(want, abs=1e-4), (args, ll, want)
    assert compared == 11
    gen = samples(tmp_path, "jaxpaged_gen")
    assert len(gen) == 4 and all(isinstance(s["resps"][0][0], str) for s in gen)
    live.wait_idle()
