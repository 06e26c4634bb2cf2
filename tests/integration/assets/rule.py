"""A deterministic rule reward for tests: depends only on the decoded response (loaded by verl by file path)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": (len(solution_str) % 7) / 7.0, "rule_len": float(len(solution_str))}
