"""A deterministic rule reward for tests: depends only on the decoded response (loaded by verl by file path)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": (len(solution_str) % 7) / 7.0, "rule_len": float(len(solution_str))}


def from_rm_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A user's reward function computed from the RM score the plugin puts in extra_info (with verl's naive manager)."""
    return {"score": 3.0 * extra_info["rm_score"] - 1.0, "saw_rms": float(len(extra_info["rm_scores"]))}
