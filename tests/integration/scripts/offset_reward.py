"""A reward for the critic's end-to-end tests: the quickstart's score plus 1.

The offset gives the returns a mean far from the zero a fresh value head predicts, so the value
loss has a large, certain fall to make however the shaped score moves."""
from megarl.reward.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    value = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return 1.0 + float(value["score"] if isinstance(value, dict) else value)  # math_dapo: dict
