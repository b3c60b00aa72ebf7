"""What "a hit computes exactly what the engine computes alone" means, for any serving engine:
the same generated tokens, and every top-k log-probability of every step within a tolerance."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def assert_same_generation(name: str, tokens: Sequence[int], logprobs: Sequence[dict[str, float]],
                           want_tokens: Sequence[int], want_logprobs: Sequence[dict[str, float]], steps: int,
                           tolerance: float) -> None:
    """``logprobs``: per generated token, ``{token id (str): logprob}`` of the top k. A token in
    one top-k only must be a near tie at the other's k-th place."""
    assert list(tokens) == list(want_tokens), f"{name}: generated tokens differ from the engine alone"
    assert len(logprobs) == len(want_logprobs) == steps, f"{name}: expected {steps} steps of logprobs"
    for step, (ours, theirs) in enumerate(zip(logprobs, want_logprobs)):
        shared = set(ours) & set(theirs)
        assert str(want_tokens[step]) in shared, f"{name}, token {step}: the chosen token's logprob is missing"
        worst = max(abs(ours[token] - theirs[token]) for token in shared)
        assert worst <= tolerance, f"{name}, token {step}: a top logprob differs by {worst:.4f} (> {tolerance})"
        for only, other in ((set(ours) - shared, theirs), (set(theirs) - shared, ours)):
            edge = min(other.values())
            for token in only:
                value = ours.get(token, theirs.get(token))
                assert value <= edge + tolerance, (
                    f"{name}, token {step}: token {token} (logprob {value:.4f}) is in one top-k only, "
                    f"and not a tie at the other's edge ({edge:.4f})")


def worst_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """The largest difference of a top-k logprob both runs report, over every generated token
    (``ours`` and ``theirs``: results with ``"logprobs"``, per token ``{token id: logprob}``)."""
    return max((abs(a[token] - b[token]) for a, b in zip(ours["logprobs"], theirs["logprobs"])
                for token in set(a) & set(b)), default=0.0)
