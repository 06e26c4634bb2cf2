"""``async_rm.combine_fn`` targets for tests, imported by name (``combine_fns:<function>``) once this folder is on
``sys.path``."""

import math

NOT_CALLABLE = 3.0


def scaled(rm_score, rule_score, data_source=None, extra_info=None):
    """Depends on every argument, so a test sees each one arrive."""
    return 10.0 * rm_score + rule_score + len(data_source or "") + float((extra_info or {}).get("bonus", 0.0))


def not_finite(rm_score, rule_score, data_source=None, extra_info=None):
    return math.nan


def not_a_number(rm_score, rule_score, data_source=None, extra_info=None):
    return "high"


def numpy_float(rm_score, rule_score, data_source=None, extra_info=None):
    import numpy as np

    return np.float32(rm_score + rule_score)


def by_name(rm_score, rule_score, data_source=None, extra_info=None, rm_scores=None):
    """Every RM's score by name: a user's own mix of several RMs (a safety gate on a helpfulness score)."""
    return rm_scores["main"] if rm_scores["safety"] > 0 else -1.0
