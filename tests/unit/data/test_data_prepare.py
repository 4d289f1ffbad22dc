"""tools/prepare_data.py: GSM8K and MATH, from small files in their own formats, to verl's
rows; megarl's loader and preflight accept them and the built-in rewards score them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import load_config
from megarl.config.preflight import preflight
from megarl.data import RLDataset
from megarl.data.prepare import PrepareError, prepare
from megarl.reward.registry import default_compute_score

ROOT = Path(__file__).resolve().parents[3]
GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
MATH_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."

GSM8K = {
    "train": [{"question": "Tom has 3 apples and buys 2. How many?",
               "answer": "He has 3 + 2 = <<3+2=5>>5.\n#### 5"},
              {"question": "A farm sells 1,200 eggs a day at $1. What is the week's take?",
               "answer": "1,200 * 7 = 8,400\n#### 8,400"}],
    "test": [{"question": "It is 3 degrees and drops 10. What is it?",
              "answer": "3 - 10 = -7\n#### -7"}],
}
MATH = {
    "train": [{"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?", "level": "Level 1",
               "type": "Prealgebra", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
              {"problem": "Solve $2x = 10$.", "level": "Level 2", "type": "Algebra",
               "solution": "So $x = \\boxed{5}$."}],
    "test": [{"problem": "What is $\\sqrt{4}$?", "level": "Level 1", "type": "Algebra",
              "solution": "First $\\boxed{3}$ is wrong; it is $\\boxed{2}$."}],
}


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def gsm8k_github(d: Path) -> Path:
    """openai/grade-school-math's data/: the splits, the socratic variant, model solutions."""
    for split, rows in GSM8K.items():
        _jsonl(d / f"{split}.jsonl", rows)
        _jsonl(d / f"{split}_socratic.jsonl", [{"question": "q", "answer": "no final answer"}])
    _jsonl(d / "example_model_solutions.jsonl", [{"x": 1}])
    return d


def gsm8k_hub(d: Path) -> Path:
    """The hub's openai/gsm8k: main/ and socratic/ parquet shards."""
    for split, rows in GSM8K.items():
        _parquet(d / "main" / f"{split}-00000-of-00001.parquet", rows)
        _parquet(d / "socratic" / f"{split}-00000-of-00001.parquet", rows[:1])
    (d / "README.md").write_text("# gsm8k\n")
    return d


def math_hendrycks(d: Path) -> Path:
    """Hendrycks' MATH/: one JSON file per problem, under <split>/<type>/<n>.json."""
    for split, rows in MATH.items():
        for i, r in enumerate(rows):
            f = d / split / r["type"].lower() / f"{10 - i}.json"  # 10.json before 9.json
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(r, indent=4))
    return d


def _read(out: Path, split: str) -> list[dict]:
    return pq.read_table(out / f"{split}.parquet").to_pylist()


def test_gsm8k_rows_are_verls(tmp_path):
    counts, skipped = prepare("gsm8k", [gsm8k_github(tmp_path / "data")], tmp_path / "out")
    assert counts == {"train": 2, "test": 1} and skipped == 3
    train = _read(tmp_path / "out", "train")
    q, a = GSM8K["train"][1]["question"], GSM8K["train"][1]["answer"]
    assert train[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{q} {GSM8K_SUFFIX}"}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "8400"},
        "extra_info": {"split": "train", "index": 1, "answer": a, "question": q}}
    assert [r["reward_model"]["ground_truth"] for r in train] == ["5", "8400"]
    test = _read(tmp_path / "out", "test")
    assert test[0]["reward_model"]["ground_truth"] == "-7"
    assert test[0]["extra_info"]["split"] == "test" and test[0]["extra_info"]["index"] == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.parquet",
                                                                     "train.parquet"]


def test_gsm8k_from_the_hubs_parquet_equals_the_jsonl(tmp_path):
    prepare("gsm8k", [gsm8k_github(tmp_path / "gh")], tmp_path / "a")
    counts, skipped = prepare("gsm8k", [gsm8k_hub(tmp_path / "hub")], tmp_path / "b")
    assert counts == {"train": 2, "test": 1} and skipped == 3  # socratic x2, README
    for split in ("train", "test"):
        assert _read(tmp_path / "a", split) == _read(tmp_path / "b", split)


def test_math_rows_are_verls_from_json_files_and_parquet(tmp_path):
    prepare("math", [math_hendrycks(tmp_path / "MATH")], tmp_path / "a")
    train = _read(tmp_path / "a", "train")
    # 9.json (the second problem) before 10.json: number order, as the files are numbered
    assert [r["reward_model"]["ground_truth"] for r in train] == ["5", "\\frac{1}{2}"]
    p = MATH["train"][1]
    assert train[0] == {
        "level": p["level"], "type": p["type"],  # kept, as verl's datasets.map keeps them
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": f"{p['problem']} {MATH_SUFFIX}"}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 0}}
    assert _read(tmp_path / "a", "test")[0]["reward_model"]["ground_truth"] == "2"  # the last
    hub = tmp_path / "lighteval" / "data"
    for split, rows in MATH.items():
        _parquet(hub / f"{split}-00000-of-00001.parquet", rows)
    prepare("math", [hub.parent], tmp_path / "b")
    assert [r["reward_model"]["ground_truth"] for r in _read(tmp_path / "b", "train")] == \
        ["\\frac{1}{2}", "5"]


def test_megarls_loader_preflight_and_rewards_take_the_output(tmp_path, qwen_dir, tokenizer):
    for name, make in (("gsm8k", gsm8k_github), ("math", math_hendrycks)):
        out = tmp_path / f"{name}_out"
        prepare(name, [make(tmp_path / name)], out)
        train, test = out / "train.parquet", out / "test.parquet"
        ds = RLDataset([train], tokenizer, bad_rows="error", max_prompt_length=512)
        assert len(ds) == 2 and ds[0].raw_prompt[0]["role"] == "user"
        preflight(load_config(None, [
            f"actor_rollout_ref.model.path={qwen_dir}",
            f"trainer.default_local_dir={tmp_path / 'runs'}", f"data.train_files={train}",
            f"data.val_files={test}", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "data.bad_rows=error",
            "data.filter_overlong_prompts=False", "data.max_prompt_length=512"]))
        for p in ds:
            gt = p.ground_truth
            right = f"So the answer is\n#### {gt}" if name == "gsm8k" else f"$\\boxed{{{gt}}}$"
            assert default_compute_score(p.data_source, right, gt, p.extra_info) == 1.0
            assert default_compute_score(p.data_source, right.replace(gt, "77"), gt) == 0.0
    # verl's MATH normalisation: a \dfrac12 answer to \frac{1}{2}
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\dfrac12}",
                                 "\\frac{1}{2}") == 1.0


@pytest.mark.parametrize("name, rows, said", [
    ("gsm8k", [{"question": "q?", "answer": "it is 5"}],
     r"train.jsonl:1: answer: no final answer '#### <number>'"),
    ("gsm8k", [{"question": "q?", "answer": "#### 1"}, {"answer": "#### 2"}],
     r"train.jsonl:2: question: missing"),
    ("gsm8k", [{"question": 7, "answer": "#### 1"}], r"train.jsonl:1: question: expected text"),
    ("math", [{"problem": "p", "solution": "the answer is 5"}],
     r"train.jsonl:1: solution: no \\boxed\{...\} answer"),
    ("math", [["p", "s"]], r"train.jsonl:1: is list, expected an object"),
])
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, name, rows, said):
    _jsonl(tmp_path / "in" / "train.jsonl", rows)
    _jsonl(tmp_path / "in" / "test.jsonl", [GSM8K["test"][0] if name == "gsm8k"
                                             else MATH["test"][0]])
    with pytest.raises(PrepareError, match=said):
        prepare(name, [tmp_path / "in"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_bad_inputs_are_refused_by_name(tmp_path):
    d = gsm8k_github(tmp_path / "d")
    (d / "test.jsonl").unlink()
    with pytest.raises(PrepareError, match=r"--input: no test files found"):
        prepare("gsm8k", [d], tmp_path / "out")
    (d / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(PrepareError, match=rf"{d / 'test.jsonl'}:2: not valid JSON"):
        prepare("gsm8k", [d], tmp_path / "out")
    with pytest.raises(PrepareError, match=r"--input: no such file or directory"):
        prepare("gsm8k", [tmp_path / "nowhere"], tmp_path / "out")
    with pytest.raises(PrepareError, match=r"--input: .*notes.jsonl: not a train or test file"):
        prepare("gsm8k", [_jsonl(tmp_path / "notes.jsonl", [])], tmp_path / "out")
    (tmp_path / "file").write_text("")
    (d / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(PrepareError, match=r"--output: .*file is a file"):
        prepare("gsm8k", [d], tmp_path / "file")


def test_outputs_are_replaced_whole_and_temp_files_do_not_stay(tmp_path):
    d = gsm8k_github(tmp_path / "d")
    out = tmp_path / "out"
    prepare("gsm8k", [d], out)
    _jsonl(d / "train.jsonl", GSM8K["train"][:1])
    prepare("gsm8k", [d], out)
    assert len(_read(out, "train")) == 1
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]
    # a single file as --input: both splits given one by one
    out2 = tmp_path / "out2"
    prepare("gsm8k", [d / "train.jsonl", d / "test.jsonl"], out2)
    assert _read(out2, "train") == _read(out, "train")


def test_the_cli_writes_and_reports_and_fails_in_one_line(tmp_path):
    d = gsm8k_github(tmp_path / "d")
    tool = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), "gsm8k"]
    ok = subprocess.run([*tool, "--input", str(d), "--output", str(tmp_path / "out")],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert f"train: 2 rows -> {tmp_path / 'out' / 'train.parquet'}" in ok.stdout
    assert "skipped 3 input file(s)" in ok.stdout
    (d / "test.jsonl").write_text('{"question": "q", "answer": "none"}\n')
    bad = subprocess.run([*tool, "--input", str(d), "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{d / 'test.jsonl'}:1: answer: no final answer" in bad.stderr
    assert len(_read(tmp_path / "out", "test")) == 1  # the earlier output stays whole


def test_without_input_or_the_datasets_library_it_says_what_to_do(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("`datasets` is installed: no --input would read the hub")
    except ImportError:
        pass
    with pytest.raises(PrepareError, match=r"--input: not given, and the hub cannot be read "
                                           r"without the `datasets` library"):
        prepare("math", [], tmp_path / "out")
