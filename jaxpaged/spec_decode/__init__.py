"""Speculative decoding: the n-gram proposer, its config and statistics, and draft verification."""
