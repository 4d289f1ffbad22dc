"""verl's data keys: apply_chat_template_kwargs reaches every templated prompt (training,
validation, preflight's lengths), reward_fn_key picks the reward's column, prompt_key the
prompt's, and bad values are refused by key."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.preflight import preflight
from megarl.config.schema import DataConfig
from megarl.config.validate import validate_config
from megarl.data import BadRowError, RLDataset, load_split
from data_helpers import row, write_jsonl, write_parquet

# Qwen3's way of turning thinking off: the template reads a kwarg of apply_chat_template.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def thinking_dir(qwen_dir, tmp_path_factory):
    """The tiny Qwen2's own tokenizer, saved with a template that reads enable_thinking."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    tok.chat_template = THINKING_TEMPLATE
    out = tmp_path_factory.mktemp("thinking_tok")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def thinking_tok(thinking_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_dir)


def test_the_kwargs_change_the_prompt_tokens(tmp_path, thinking_tok):
    path = write_parquet(tmp_path / "train.parquet", [row("What is 1 + 2?", "3")])
    plain = RLDataset(path, thinking_tok)[0].prompt_ids
    off = RLDataset(path, thinking_tok, apply_chat_template_kwargs=NO_THINKING)[0].prompt_ids
    assert off != plain and off[:len(plain)] == plain
    assert thinking_tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking_tok.decode(plain).endswith("<|im_start|>assistant\n")
    want = thinking_tok.apply_chat_template(row()["prompt"], add_generation_prompt=True,
                                            tokenize=False, enable_thinking=False)
    assert off == thinking_tok(want, add_special_tokens=False)["input_ids"]


def test_training_and_validation_sets_both_get_them(tmp_path, thinking_tok):
    train = write_jsonl(tmp_path / "train.jsonl", [row(), row("What is 2 + 2?", "4")])
    val = write_jsonl(tmp_path / "val.jsonl", [row("What is 5 + 5?", "10")])
    d = OmegaConf.merge(OmegaConf.structured(DataConfig),
                        {"train_files": str(train), "val_files": str(val),
                         "apply_chat_template_kwargs": NO_THINKING})
    for split in ("train", "val"):
        ds = load_split(d, thinking_tok, split)
        assert all(thinking_tok.decode(p.prompt_ids).endswith("</think>\n\n") for p in ds)


def test_preflights_length_check_templates_with_them(tmp_path, qwen_dir, thinking_dir,
                                                     thinking_tok):
    train = write_jsonl(tmp_path / "train.jsonl", [row(f"What is {i} + 0?", str(i))
                                                   for i in range(4)])
    plain = len(RLDataset(train, thinking_tok)[0].prompt_ids)
    off = len(RLDataset(train, thinking_tok, apply_chat_template_kwargs=NO_THINKING)[0]
              .prompt_ids)
    assert off > plain
    args = [f"actor_rollout_ref.model.path={qwen_dir}",
            f"actor_rollout_ref.model.tokenizer_path={thinking_dir}",
            f"trainer.default_local_dir={tmp_path / 'runs'}", f"data.train_files={train}",
            "data.filter_overlong_prompts=False", f"data.max_prompt_length={plain}"]
    preflight(load_config(None, args))  # fits without the kwarg
    with pytest.raises(ConfigError, match=rf"{train}:1: prompt: prompt is {off} tokens"):
        preflight(load_config(None, [*args,
                                     "data.apply_chat_template_kwargs.enable_thinking=false"]))


@pytest.mark.parametrize("value, said", [
    (5, r"data.apply_chat_template_kwargs: expected a mapping .* got int 5"),
    ("enable_thinking=False", r"data.apply_chat_template_kwargs: expected a mapping .* got str"),
    ({"tokenize": True}, r"data.apply_chat_template_kwargs.tokenize: megarl sets this"),
    ({"add_generation_prompt": False}, r"data.apply_chat_template_kwargs.add_generation_prompt"),
])
def test_bad_kwargs_are_refused_naming_the_key(tmp_path, tokenizer, value, said):
    path = write_jsonl(tmp_path / "train.jsonl", [row()])
    with pytest.raises(ConfigError, match=said):
        RLDataset(path, tokenizer, apply_chat_template_kwargs=value)


@pytest.mark.parametrize("override, said", [
    ("data.apply_chat_template_kwargs=5", r"data.apply_chat_template_kwargs: "),
    ("data.apply_chat_template_kwargs={enable_thinking:false}",
     r"'enable_thinking:false' is not a keyword argument name \(to set enable_thinking"),
    ("data.apply_chat_template_kwargs={return_dict: true}",
     r"data.apply_chat_template_kwargs.return_dict: megarl sets this"),
    ("data.reward_fn_key=''", r"data.reward_fn_key: expected the name of a data column"),
])
def test_bad_values_fail_when_the_config_is_checked(override, said):
    with pytest.raises(ConfigError, match=said):
        validate_config(load_config(None, [override]))


def test_verls_defaults_and_spellings_load():
    cfg = load_config(None, [])
    assert (cfg.data.reward_fn_key, cfg.data.return_raw_chat, cfg.data.prompt_key) == \
        ("data_source", True, "prompt")
    assert dict(cfg.data.apply_chat_template_kwargs) == {}
    for spelling in ("+data.apply_chat_template_kwargs.enable_thinking=False",
                     "data.apply_chat_template_kwargs={enable_thinking: false}"):
        cfg = load_config(None, [spelling, "data.return_raw_chat=False"])
        validate_config(cfg)
        assert dict(cfg.data.apply_chat_template_kwargs) == NO_THINKING


def test_reward_fn_key_picks_the_column_the_reward_is_chosen_by(tmp_path, tokenizer):
    rows = [{**row(), "task": "openai/gsm8k"}, {**row(), "task": "lighteval/MATH"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    ds = RLDataset(path, tokenizer, reward_fn_key="task")
    assert [p.data_source for p in ds] == ["openai/gsm8k", "lighteval/MATH"]
    assert [p.data_source for p in RLDataset(path, tokenizer)] == ["megarl/quickstart"] * 2
    missing = write_jsonl(tmp_path / "missing.jsonl", [row(), {**row(), "task": "x"}])
    with pytest.raises(BadRowError, match=rf"{missing}:1: task: missing"):
        RLDataset(missing, tokenizer, reward_fn_key="task", bad_rows="error")


def test_reward_fn_key_and_prompt_key_end_to_end_in_preflight(tmp_path, qwen_dir):
    """A data set with its own column names: the prompt under `question`, the reward's
    source under `task`; preflight's unknown-source check reads `task`."""
    def own(i, task="openai/gsm8k"):
        return {"question": [{"role": "user", "content": f"What is {i} + 1?"}], "task": task,
                "data_source": "not/a_source", "reward_model": {"ground_truth": str(i + 1)}}

    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(own(i)) for i in range(4)) + "\n")
    args = [f"actor_rollout_ref.model.path={qwen_dir}",
            f"trainer.default_local_dir={tmp_path / 'runs'}", f"data.train_files={train}",
            "data.prompt_key=question", "data.reward_fn_key=task",
            "data.filter_overlong_prompts=False", "data.max_prompt_length=64"]
    preflight(load_config(None, args))
    with pytest.raises(ConfigError, match=rf"{train}:1: prompt: missing"):
        preflight(load_config(None, args[:-4]))  # prompt_key left at `prompt`
    train.write_text("\n".join(json.dumps(own(i, "my/task")) for i in range(4)) + "\n")
    with pytest.raises(ConfigError, match=rf"{train}:1: no built-in reward for data_source "
                                          r"'my/task'"):
        preflight(load_config(None, args))
