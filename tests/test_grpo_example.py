"""examples/grpo_smollm2.py: two GRPO steps on a tiny random model (rollouts -> rewards -> loss -> optax ->
update_weights -> rollouts), the engine's log-probs equal to the trainer's forward within 1e-5 (the example
measures 0, on SmolLM2 too: docs/rl.md)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def grpo():
    return load_script("examples/grpo_smollm2.py")


def test_two_steps(grpo, tiny_checkpoints, monkeypatch):
    updates = []
    real_update = grpo.LLM.update_weights

    def update(llm, weights):  # what the engine holds after each step must be the trainer's new params
        updates.append((llm, weights))
        return real_update(llm, weights)

    monkeypatch.setattr(grpo.LLM, "update_weights", update)
    history = grpo.main(["--model", str(tiny_checkpoints["gqa4"]), "--steps", "2", "--prompts", "2",
                         "--samples", "3", "--max-tokens", "6", "--max-model-len", "128", "--learning-rate", "1e-2"])
    assert [row["step"] for row in history] == [0, 1]
    for row in history:
        assert 0 < row["tokens"] <= 2 * 3 * 6
        assert row["max_token_gap"] <= 1e-5 and row["max_sequence_gap"] <= 1e-5
        assert np.isfinite(row["loss"]) and 0.0 <= row["reward"] <= 1.0
    assert len(updates) == 2
    llm, sent = updates[-1]
    held = llm.get_weights()
    for name, value in sent.items():
        np.testing.assert_array_equal(held[name], value)
    first = updates[0][1]
    assert any(not np.array_equal(first[n], sent[n]) for n in sent)  # the second step moved the weights again


def test_rewards_and_advantages(grpo):
    assert grpo.reward(" 12 is the answer", 12) == 1.0
    assert grpo.reward("maybe 13", 12) == 0.1
    assert grpo.reward("no idea", 12) == 0.0
    samples = [dict(group=0), dict(group=0), dict(group=1), dict(group=1)]
    adv = grpo.advantages(samples, np.array([1.0, 0.0, 0.5, 0.5], np.float32))
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0
