"""Comparing generations given as (token ids, logprob of each token) per prompt, as engines' probes return them."""

import pytest


def assert_same_generations(a, b):
    """Same tokens and, within 1e-6, the same logprobs, prompt by prompt."""
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(a, b, strict=True):
        assert tokens_a == tokens_b
        assert logprobs_a == pytest.approx(logprobs_b, abs=1e-6)


def largest_logprob_change(before, after) -> float:
    return max(abs(x - y) for (_, lp_before), (_, lp_after) in zip(before, after) for x, y in zip(lp_before, lp_after))
