"""load_reward_fn (dispatch, import paths and their errors), score_batch, math exact match."""
from __future__ import annotations

import pytest

from megarl.config.errors import ConfigError
from megarl.data.dataset import Prompt
from megarl.reward import default_compute_score, load_reward_fn, score_batch
from megarl.reward.math_exact import compute_score as math_score, extract_answer, last_boxed


def _p(ds="megarl/quickstart", gt="7", uid="t:1"):
    return Prompt(index=0, uid=uid, prompt_ids=[1], raw_prompt="q", data_source=ds,
                  ground_truth=gt, extra_info={})


def test_default_dispatch_by_data_source():
    fn = load_reward_fn(None)
    assert fn is default_compute_score and load_reward_fn("") is fn
    assert fn("megarl/quickstart", "7", "7") == 1.0
    assert fn("openai/gsm8k", "so #### 1,000", "1000") == 1.0
    assert fn("my-math-set", "\\boxed{3}", "4") == 0.0
    with pytest.raises(ValueError, match="reward.reward_fn"):
        fn("unknown/source", "7", "7")


def test_math_exact_match():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{open") is None
    assert extract_answer("I think 3 then 4.5.") == "4.5"
    assert extract_answer("no numbers") is None
    assert math_score("math", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert math_score("math", "\\boxed{$1,000$}", "1000.0") == 1.0
    assert math_score("gsm8k", "answer: 72", "She sold 48/2 = 24 ... #### 72") == 1.0
    assert math_score("gsm8k", "answer: 71", "72") == 0.0
    assert math_score("gsm8k", "none", "72") == 0.0


def test_import_paths(tmp_path):
    fn = load_reward_fn("megarl.reward.quickstart:compute_score")
    assert fn("x", "7", 7) == 1.0
    f = tmp_path / "my_reward.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': len(solution_str)}\n")
    fn = load_reward_fn(f"{f}:score")
    assert score_batch(fn, [_p(), _p()], ["ab", ""]) == [2.0, 0.0]


@pytest.mark.parametrize("path,match", [
    ("megarl.reward.quickstart", "not an import path"),
    ("megarl.reward.quickstart:", "not an import path"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("megarl.reward.quickstart:nope", "has no attribute 'nope'"),
    ("megarl.reward.quickstart:DATA_SOURCE", "not callable"),
    ("/no/such/file.py:fn", "no such file"),
])
def test_import_path_errors_name_the_key(path, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_reward_fn(path)
    assert str(err.value).startswith("reward.reward_fn:")


def test_a_function_that_cannot_take_extra_info_is_refused_at_load(tmp_path):
    """A run always passes extra_info (the finish reason at least), as verl does."""
    f = tmp_path / "three.py"
    f.write_text("def score(data_source, solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"reward.reward_fn: .*score\(data_source, "
                                          r"solution_str, ground_truth\) cannot be called"):
        load_reward_fn(f"{f}:score")
    f.write_text("def score(*args, **kwargs):\n    return 1.0\n")
    assert load_reward_fn(f"{f}:score")("d", "s", "g", {}) == 1.0


def test_a_directory_named_like_a_file_is_said_to_be_one(tmp_path):
    (tmp_path / "rewards.py").mkdir()
    with pytest.raises(ConfigError, match="rewards.py is a directory, not a Python file"):
        load_reward_fn(f"{tmp_path / 'rewards.py'}:fn")


def test_module_raising_on_import(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="reward.reward_fn: .*RuntimeError: boom"):
        load_reward_fn(f"{f}:fn")


def test_score_batch():
    items = [_p(gt="7"), _p(gt="3", uid="t:2")]
    assert score_batch(load_reward_fn(None), items, ["7", "3"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 1 solutions"):
        score_batch(default_compute_score, items, ["7"])

    def failing(*a):
        raise KeyError("x")

    with pytest.raises(RuntimeError, match="failed on prompt t:1"):
        score_batch(failing, items, ["7", "3"])
    with pytest.raises(ValueError, match="returned None for prompt t:1"):
        score_batch(lambda *a: None, items, ["7", "3"])
    with pytest.raises(ValueError, match="finite"):
        score_batch(lambda *a: float("nan"), items, ["7", "3"])
