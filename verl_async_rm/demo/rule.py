"""The demo's rule reward, loaded by verl by file path (``reward.custom_reward_function.path``).

A stand-in for a format/correctness rule: 1.0 when the ground truth appears in the response, plus a brevity term
that falls from 0.5 to 0 as the response grows to 1,000 characters. It depends only on the decoded response.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_score"]


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any):
    """verl's ``custom_reward_function`` signature; returns ``{"score": float, "rule_chars": float}``."""
    text = str(solution_str)
    correct = 1.0 if ground_truth is not None and str(ground_truth) in text else 0.0
    brevity = 0.5 * max(0.0, 1.0 - len(text) / 1000.0)
    return {"score": correct + brevity, "rule_chars": float(len(text))}
