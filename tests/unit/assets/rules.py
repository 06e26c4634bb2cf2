"""Rule functions for tests, loaded by verl from this file (``reward.custom_reward_function.path``)."""

import math


def exact_match(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the decoded response equals the ground truth; reports info keys that clash with the manager's own."""
    return {
        "score": 1.0 if solution_str == ground_truth else 0.0,
        "response_chars": float(len(solution_str)),
        "rm_score": -1.0,
        "rule_score": -2.0,
    }


def not_finite(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return math.nan


def from_rm_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A user's reward function that uses the RM score the plugin put in extra_info (and every RM's, by name)."""
    scores = extra_info["rm_scores"]
    return 3.0 * extra_info["rm_score"] - 1.0 + 0.5 * sum(v for k, v in scores.items() if k != "main")
