"""The quickstart task files: convention, determinism, atomic writes, kept when present."""
from __future__ import annotations

import json

from megarl.data import RLDataset, make_quickstart_task
from megarl.reward import load_reward_fn, score_batch


def test_writes_loadable_task(tmp_path, tokenizer):
    paths = make_quickstart_task(tmp_path / "qs", n_train=64, n_val=16, seed=0)
    assert sorted(p.name for p in (tmp_path / "qs").iterdir()) == ["train.jsonl", "val.jsonl"]
    train = RLDataset(paths["train"], tokenizer, bad_rows="error", max_prompt_length=64,
                      filter_overlong_prompts=False)
    val = RLDataset(paths["val"], tokenizer, bad_rows="error", config_key="data.val_files")
    assert (len(train), len(val)) == (64, 16)
    p = train[0]
    assert p.data_source == "megarl/quickstart"
    a, b = p.extra_info["a"], p.extra_info["b"]
    assert p.raw_prompt == [{"role": "user", "content": f"What is {a} + {b}?"}]
    assert p.ground_truth == str(a + b) and 0 <= a <= 9 and 0 <= b <= 9
    # Held-out validation pairs never appear in training.
    pairs = lambda ds: {(q.extra_info["a"], q.extra_info["b"]) for q in ds}  # noqa: E731
    assert not pairs(train) & pairs(val)
    # The default reward scores the exact answers 1.0.
    assert score_batch(load_reward_fn(None), list(val), [q.ground_truth for q in val]) == [1.0] * 16


def test_deterministic_and_kept_unless_overwrite(tmp_path):
    a = make_quickstart_task(tmp_path / "a", n_train=32, n_val=8, seed=3)
    b = make_quickstart_task(tmp_path / "b", n_train=32, n_val=8, seed=3)
    assert a["train"].read_text() == b["train"].read_text()
    before = a["train"].read_text()
    make_quickstart_task(tmp_path / "a", n_train=8, n_val=2, seed=4)  # exists: kept
    assert a["train"].read_text() == before
    make_quickstart_task(tmp_path / "a", n_train=8, n_val=2, seed=4, overwrite=True)
    lines = a["train"].read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[0])["reward_model"]["style"] == "rule"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["train.jsonl", "val.jsonl"]


def test_explicit_file_names(tmp_path):
    paths = make_quickstart_task(tmp_path, n_train=4, n_val=2,
                                 train_file=tmp_path / "x" / "t.jsonl",
                                 val_file=tmp_path / "y" / "v.jsonl")
    assert paths == {"train": tmp_path / "x" / "t.jsonl", "val": tmp_path / "y" / "v.jsonl"}
    assert len(paths["train"].read_text().splitlines()) == 4
    assert len(paths["val"].read_text().splitlines()) == 2


def test_last_digit_task(tmp_path, tokenizer):
    from megarl.data import make_synthetic_task

    paths = make_synthetic_task("last_digit", tmp_path / "ld", n_train=64, n_val=16, seed=0)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()]
            for k, p in paths.items()}
    assert len(rows["train"]) == 64 and len(rows["val"]) == 16
    r = rows["val"][0]
    digits = r["extra_info"]["digits"]
    assert r["prompt"] == f"Repeat the last digit: {' '.join(digits)}"  # plain text, no chat
    assert r["reward_model"]["ground_truth"] == digits[-1]
    assert r["data_source"] == "megarl/last_digit"
    strings = {k: {x["extra_info"]["digits"] for x in v} for k, v in rows.items()}
    assert len(strings["train"]) == 64 and not strings["train"] & strings["val"]
    # the plain-text prompt ends with the answer's token, which the engine continues from
    ds = RLDataset(str(paths["val"]), tokenizer, max_prompt_length=64)
    assert tokenizer.decode(ds[0].prompt_ids[-1:]).strip() == digits[-1]


def test_a_run_writes_the_synthetic_task_under_the_configs_file_names(tmp_path):
    """prepare_assets: data.train_files / data.val_files name the files it writes (it wrote
    train.jsonl and val.jsonl beside train_files whatever they were called), and a missing
    val file is written though the train file is there."""
    from megarl.config import load_config
    from megarl.controller.setup import prepare_assets

    train, val = tmp_path / "d" / "my_train.jsonl", tmp_path / "e" / "my_val.jsonl"
    cfg = load_config(None, ["data.synthetic_task=last_digit", f"data.train_files={train}",
                             f"data.val_files={val}",
                             f"actor_rollout_ref.model.path={tmp_path / 'm'}",
                             "actor_rollout_ref.model.make_tiny=qwen2"])
    prepare_assets(cfg)
    assert train.is_file() and val.is_file()
    assert not (tmp_path / "d" / "train.jsonl").exists()
    val.unlink()
    before = train.read_bytes()
    prepare_assets(cfg)
    assert val.is_file() and train.read_bytes() == before
