"""Sampling: the on-device sampler a step program runs, and the grammars that mask its logits."""
