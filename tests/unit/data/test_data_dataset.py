"""RLDataset: formats, chat vs text prompts, bad rows by file:row, overlong prompts."""
from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from megarl.config.errors import ConfigError
from megarl.config.schema import DataConfig
from megarl.data import BadRowError, RLDataset, load_split
from data_helpers import row, write_jsonl, write_parquet


def _chat_ids(tok, msgs):
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_loads_chat_and_text_prompts(tmp_path, tokenizer):
    rows = [row("What is 1 + 2?", "3"), row("What is 4 + 4? ", "8", text=True),
            {**row("What is 2 + 2?", 4), "extra_info": None}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    ds = RLDataset(str(path), tokenizer)
    assert len(ds) == 3
    chat, text, third = ds[0], ds[1], ds[2]
    assert chat.prompt_ids == _chat_ids(tokenizer, rows[0]["prompt"])
    assert tokenizer.decode(chat.prompt_ids).endswith("<|im_start|>assistant\n")
    assert text.prompt_ids == tokenizer("What is 4 + 4? ")["input_ids"]
    assert [p.uid for p in ds] == ["train:1", "train:2", "train:3"]
    assert [p.index for p in ds] == [0, 1, 2]
    assert chat.ground_truth == "3" and chat.data_source == "megarl/quickstart"
    assert chat.raw_prompt == rows[0]["prompt"] and chat.extra_info == {"k": 1}
    assert third.extra_info == {} and third.ground_truth == 4


def test_parquet_matches_jsonl(tmp_path, tokenizer):
    # Parquet columns have one type, so chat and text prompts live in separate files.
    chat = [row("What is 1 + 2?", "3"), {**row("What is 5 + 2?", "7"), "extra_info": None}]
    text = [row("What is 4 + 4?", "8", text=True)]
    from_parquet = RLDataset([write_parquet(tmp_path / "c.parquet", chat),
                              write_parquet(tmp_path / "t.parquet", text)], tokenizer)
    from_jsonl = RLDataset([write_jsonl(tmp_path / "c.jsonl", chat),
                            write_jsonl(tmp_path / "t.jsonl", text)], tokenizer)
    assert [p.uid for p in from_parquet] == ["c:1", "c:2", "t:1"]
    for a, b in zip(from_parquet, from_jsonl):
        assert (a.prompt_ids, a.raw_prompt, a.ground_truth, a.extra_info, a.data_source) == \
            (b.prompt_ids, b.raw_prompt, b.ground_truth, b.extra_info, b.data_source)
    assert from_parquet[1].extra_info == {}


def test_several_files_and_stable_uids(tmp_path, tokenizer):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_jsonl(tmp_path / "a" / "train.jsonl", [row(), row()])
    b = write_parquet(tmp_path / "b" / "train.parquet", [row()])
    c = write_jsonl(tmp_path / "other.jsonl", ["", row()])  # blank line 1: row number 2
    ds = RLDataset([a, b, c], tokenizer)
    assert [p.uid for p in ds] == ["train#0:1", "train#0:2", "train#1:1", "other:2"]
    assert [p.uid for p in RLDataset([a, b, c], tokenizer)] == [p.uid for p in ds]


BAD = [  # (row as written, field named in the report)
    ('{"prompt": ', "<row>"),
    ("[1, 2]", "<row>"),
    (row(prompt=None), "prompt"),
    ({k: v for k, v in row().items() if k != "prompt"}, "prompt"),
    (row(prompt="   ", text=True), "prompt"),
    (row(prompt=[]), "prompt"),
    (row(prompt=[{"role": "user", "content": ""}]), "prompt"),
    (row(prompt=[{"role": "user"}]), "prompt"),
    (row(prompt=["hi"]), "prompt"),
    (row(prompt=42), "prompt"),
    ({k: v for k, v in row().items() if k != "data_source"}, "data_source"),
    (row(data_source=3), "data_source"),
    ({k: v for k, v in row().items() if k != "reward_model"}, "reward_model"),
    (row(reward_model="7"), "reward_model"),
    (row(reward_model={"style": "rule"}), "reward_model.ground_truth"),
    (row(reward_model={"ground_truth": "1", "style": 5}), "reward_model.style"),
    (row(extra_info=[1]), "extra_info"),
]


@pytest.mark.parametrize("bad,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_row_reported_in_both_modes(tmp_path, tokenizer, caplog, bad, field):
    path = write_jsonl(tmp_path / "d.jsonl", [row(), row(), bad, row()])
    with pytest.raises(BadRowError) as err:
        RLDataset(path, tokenizer, bad_rows="error")
    assert f"{path}:3: {field}:" in str(err.value)
    assert isinstance(err.value, ValueError)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = RLDataset(path, tokenizer, bad_rows="skip")
    assert [p.uid for p in ds] == ["d:1", "d:2", "d:4"] and ds.num_bad_rows == 1
    assert "skipped 1 bad row" in caplog.text and f"{path}:3: {field}:" in caplog.text


def test_bad_parquet_rows_and_summary(tmp_path, tokenizer):
    rows = [row(), row(gt=None)] + [row(data_source="")] * 7
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(BadRowError) as err:
        RLDataset(path, tokenizer, bad_rows="error")
    msg = str(err.value)
    # One line: the first bad row in full, then the count and where the others are.
    assert msg.startswith(f"{path}:2: reward_model.ground_truth: missing") and "\n" not in msg
    assert "8 bad row(s)" in msg and f"also at {path}:3, {path}:4" in msg and "and 2 more" in msg
    assert len(RLDataset(path, tokenizer)) == 1


def test_missing_file_names_path_and_key(tmp_path, tokenizer):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=r"data\.val_files: no such data file: .*nope\.jsonl"):
        RLDataset(missing, tokenizer, config_key="data.val_files")
    with pytest.raises(ConfigError, match="data.train_files"):
        RLDataset([], tokenizer)
    bad_ext = write_jsonl(tmp_path / "x.csv", [row()])
    with pytest.raises(ConfigError, match="unknown format"):
        RLDataset(bad_ext, tokenizer)


def test_overlong_prompts(tmp_path, tokenizer, caplog):
    long_text = "What is 1 + 2? " * 20
    path = write_jsonl(tmp_path / "d.jsonl", [row(), row(long_text, text=True), row()])
    full = tokenizer(long_text)["input_ids"]
    limit = 30
    assert len(full) > limit >= len(RLDataset(path, tokenizer)[0].prompt_ids)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert [p.uid for p in ds] == ["d:1", "d:3"] and ds.num_filtered == 1
    assert "filtered 1 prompt" in caplog.text
    kw = dict(max_prompt_length=limit, filter_overlong_prompts=False)
    left = RLDataset(path, tokenizer, truncation="left", **kw)[1].prompt_ids
    right = RLDataset(path, tokenizer, truncation="right", **kw)[1].prompt_ids
    assert left == full[-limit:] and right == full[:limit]
    with pytest.raises(ValueError, match=rf"{path}:2: prompt: prompt is {len(full)} tokens"):
        RLDataset(path, tokenizer, truncation="error", **kw)


def test_custom_prompt_key_and_bad_options(tmp_path, tokenizer):
    r = row()
    r["question"] = r.pop("prompt")
    path = write_jsonl(tmp_path / "d.jsonl", [r])
    assert len(RLDataset(path, tokenizer, prompt_key="question")) == 1
    with pytest.raises(BadRowError, match="d.jsonl:1: prompt: missing"):
        RLDataset(path, tokenizer, bad_rows="error")
    with pytest.raises(ConfigError, match="data.truncation"):
        RLDataset(path, tokenizer, truncation="middle")
    with pytest.raises(ConfigError, match="data.bad_rows"):
        RLDataset(path, tokenizer, bad_rows="ignore")


def test_load_split_from_config(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "t.jsonl", [row(), row()])
    val = write_parquet(tmp_path / "v.parquet", [row()])
    cfg = OmegaConf.structured(DataConfig(train_files=[str(train)], val_files=str(val)))
    assert len(load_split(cfg, tokenizer, "train")) == 2
    assert len(load_split(cfg, tokenizer, "val")) == 1
    cfg.val_files = None
    assert load_split(cfg, tokenizer, "val") is None
    cfg.train_files = str(tmp_path / "gone.jsonl")
    with pytest.raises(ConfigError, match="data.train_files: no such data file"):
        load_split(cfg, tokenizer, "train")
