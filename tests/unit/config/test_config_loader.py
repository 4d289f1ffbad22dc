"""load_config: defaults < YAML < overrides, Hydra-style overrides, aliases, key errors."""
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import ReadonlyConfigError

from design_usage import DESIGN_OVERRIDES
from megarl.config import ConfigError, load_config, to_yaml

REPO = Path(__file__).resolve().parents[3]



def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_empty_overrides_on_defaults_validate():
    cfg = load_config(None, [])
    assert isinstance(cfg, DictConfig)
    assert cfg.trainer.separated_node_ratios == [1.0]
    # max_new_tokens defaults to the data's response budget.
    assert cfg.actor_rollout_ref.rollout.max_new_tokens == cfg.data.max_response_length


def test_design_usage_keys_parse_verbatim():
    # 4 devices on one node: 0.25 of them is one device per single-task group.
    cfg = load_config(None, DESIGN_OVERRIDES + ["trainer.n_gpus_per_node=4"])
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    assert arr.async_pipeline is True
    assert isinstance(t.separated_node_tasks, ListConfig)
    assert list(t.separated_node_tasks[0]) == ["logp", "actor-train"]
    assert list(t.separated_node_tasks[1:]) == ["ref_logp", "generate"]
    assert list(t.separated_node_ratios) == [0.5, 0.25, 0.25]
    assert all(isinstance(r, float) for r in t.separated_node_ratios)
    assert arr.rollout.enable_dual_buffer is True
    assert arr.rollout.param_update_preduce_bucket_size_mb == 512
    assert arr.rollout.param_update_consume_bucket_size_mb == 128
    assert type(arr.rollout.param_update_preduce_bucket_size_mb) is int
    assert t.generate_ahead_steps == 2
    assert "sperated" not in to_yaml(cfg)


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_plus_prefixes_are_plain_assignments(prefix):
    cfg = load_config(None, [f"{prefix}trainer.test_freq=7"])
    assert cfg.trainer.test_freq == 7


def test_override_values_parse_as_yaml():
    cfg = load_config(None, [
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.val_before_train=True",
        "data.val_files=[a.jsonl,b.jsonl]",
        "trainer.logger=[console,tensorboard]",
        "actor_rollout_ref.model.override_config.attention_dropout=0.1",
    ])
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.val_before_train is True
    assert list(cfg.data.val_files) == ["a.jsonl", "b.jsonl"]
    assert list(cfg.trainer.logger) == ["console", "tensorboard"]
    assert cfg.actor_rollout_ref.model.override_config.attention_dropout == 0.1


def test_yaml_then_overrides_precedence(tmp_path):
    path = write(tmp_path, "trainer:\n  test_freq: 5\n  save_freq: 9\n"
                           "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-5\n")
    cfg = load_config(path, ["trainer.test_freq=6"])
    assert cfg.trainer.test_freq == 6            # override beats YAML
    assert cfg.trainer.save_freq == 9            # YAML beats default
    assert cfg.trainer.total_epochs == 1         # default kept
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)


def test_alias_in_yaml_and_override_beats_yaml(tmp_path):
    path = write(tmp_path, "trainer:\n  n_gpus_per_node: 4\n"
                           "  sperated_node_tasks: [[logp, actor-train, ref_logp], generate]\n"
                           "  sperated_node_ratios: [0.5, 0.5]\n")
    cfg = load_config(path, [])
    assert list(cfg.trainer.separated_node_ratios) == [0.5, 0.5]
    cfg = load_config(path, ["trainer.separated_node_ratios=[0.75,0.25]"])
    assert list(cfg.trainer.separated_node_ratios) == [0.75, 0.25]


def test_both_alias_spellings_with_different_values_is_an_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.separated_node_ratios=[1.0]",
                           "trainer.sperated_node_ratios=[0.5,0.5]"])
    assert "trainer.separated_node_ratios" in str(err.value)
    assert "trainer.sperated_node_ratios" in str(err.value)


def test_both_alias_spellings_in_yaml_conflict(tmp_path):
    path = write(tmp_path, "trainer:\n  sperated_node_tasks: [[generate, logp]]\n"
                           "  separated_node_tasks: [[generate, ref_logp]]\n")
    with pytest.raises(ConfigError, match="sperated_node_tasks.*separated_node_tasks"):
        load_config(path, [])


def test_both_alias_spellings_with_equal_values_are_fine():
    cfg = load_config(None, ["trainer.separated_node_ratios=[1.0]",
                             "+trainer.sperated_node_ratios=[1.0]"])
    assert list(cfg.trainer.separated_node_ratios) == [1.0]


def test_unknown_override_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.test_frq=3"])
    msg = str(err.value)
    assert "trainer.test_frq" in msg and "did you mean `trainer.test_freq`?" in msg


def test_unknown_section_suggests_whole_path():
    with pytest.raises(ConfigError, match=r"trainr\.nnodes.*did you mean `trainer\.nnodes`"):
        load_config(None, ["trainr.nnodes=2"])


def test_right_name_wrong_section_suggests_the_key_elsewhere():
    with pytest.raises(ConfigError,
                       match=r"did you mean `actor_rollout_ref\.async_pipeline`"):
        load_config(None, ["trainer.async_pipeline=True"])


def test_unknown_yaml_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "actor_rollout_ref:\n  rollout:\n    temprature: 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    msg = str(err.value)
    assert "actor_rollout_ref.rollout.temprature" in msg
    assert path in msg
    assert "did you mean `actor_rollout_ref.rollout.temperature`?" in msg


def test_type_error_names_key():
    with pytest.raises(ConfigError, match=r"^trainer\.nnodes: "):
        load_config(None, ["trainer.nnodes=abc"])


def test_type_error_in_yaml_names_key_and_file(tmp_path):
    path = write(tmp_path, "data:\n  train_batch_size: many\n")
    with pytest.raises(ConfigError, match=r"data\.train_batch_size.*cfg\.yaml"):
        load_config(path, [])


def test_value_is_not_a_section():
    with pytest.raises(ConfigError, match=r"trainer\.nnodes\.x.*not a section"):
        load_config(None, ["trainer.nnodes.x=1"])


def test_section_needs_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="^trainer: "):
        load_config(write(tmp_path, "trainer: 3\n"), [])


def test_missing_yaml_file_names_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(missing, [])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="trainer.nnodes"):
        load_config(None, ["trainer.nnodes"])


def test_result_is_read_only():
    cfg = load_config(None, [])
    with pytest.raises(ReadonlyConfigError):
        cfg.trainer.nnodes = 3


@pytest.mark.parametrize("name", ["quickstart.yaml", "qwen2_7b_async.yaml", "qwen3_8b_async.yaml",
                                  "qwen3_30b_a3b_async.yaml", "glm45_355b.yaml",
                                  "deepseek_v3_671b.yaml"])
def test_shipped_configs_load_and_validate(name):
    cfg = load_config(str(REPO / "configs" / name), [])
    assert cfg.actor_rollout_ref.async_pipeline is True
    assert cfg.trainer.generate_ahead_steps == 2


def test_quickstart_layout():
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [])
    assert cfg.trainer.device == "cpu" and cfg.trainer.n_gpus_per_node == 2
    assert [list(g) for g in cfg.trainer.separated_node_tasks] == [
        ["logp", "actor-train", "ref_logp"], ["generate"]]
    assert cfg.actor_rollout_ref.model.path == "outputs/tiny-qwen2"


def test_cluster_example_layout():
    cfg = load_config(str(REPO / "configs" / "qwen2_7b_async.yaml"), [])
    r = cfg.actor_rollout_ref.rollout
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (4, 8)
    assert r.name == "sglang" and r.enable_dual_buffer is True
    assert (r.param_update_preduce_bucket_size_mb, r.param_update_consume_bucket_size_mb) == (
        512, 128)


# ------------------------------------------------- async_pipeline: an alias of generate_ahead_steps
ASYNC, AHEAD = "actor_rollout_ref.async_pipeline", "trainer.generate_ahead_steps"


def _ahead(cfg):
    return cfg.actor_rollout_ref.async_pipeline, cfg.trainer.generate_ahead_steps


@pytest.mark.parametrize("overrides, want", [
    ([], (False, 1)),
    ([f"{ASYNC}=True"], (True, 2)),                # the seed's key alone: one step off
    ([f"{AHEAD}=3"], (True, 3)),                   # the one knob alone sets the alias
    ([f"{ASYNC}=True", f"{AHEAD}=3"], (True, 3)),
    ([f"{ASYNC}=False", f"{AHEAD}=1"], (False, 1)),
])
def test_async_pipeline_sets_generate_ahead_steps(overrides, want):
    assert _ahead(load_config(None, overrides)) == want


def test_the_ahead_given_closer_to_the_run_wins(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref: {async_pipeline: true}\ntrainer: {generate_ahead_steps: 3}\n")
    assert _ahead(load_config(str(f))) == (True, 3)
    assert _ahead(load_config(str(f), [f"{ASYNC}=False"])) == (False, 1)
    assert _ahead(load_config(str(f), [f"{AHEAD}=1"])) == (False, 1)


def test_contradicting_ahead_keys_at_one_level_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{ASYNC}=False", f"{AHEAD}=2"])
    assert str(err.value).startswith(f"{AHEAD}: 2 and {ASYNC}: false contradict")
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref: {async_pipeline: true}\ntrainer: {generate_ahead_steps: 1}\n")
    with pytest.raises(ConfigError, match=rf"{AHEAD}: 1 and {ASYNC}: true .*c\.yaml"):
        load_config(str(f))


def test_a_file_read_again_is_parsed_once_and_its_edits_are_seen(tmp_path, monkeypatch):
    """`megarl plan` loads one file hundreds of times: the text is parsed once; each load
    gets its own copy (a config built from it cannot change the next), and an edited file
    is read anew."""
    import megarl.config.loader as loader

    text = f"# {tmp_path}\ntrainer:\n  separated_node_ratios: [1.0]\n  total_training_steps: 7\n"
    path = write(tmp_path, text)  # a text no other test parsed before
    parsed = []
    real = loader.yaml.load
    monkeypatch.setattr(loader.yaml, "load", lambda *a, **k: parsed.append(1) or real(*a, **k))
    first = loader._read_yaml(path)
    first["trainer"]["separated_node_ratios"].append(9.0)  # a caller's edit stays its own
    assert load_config(path, []).trainer.separated_node_ratios == [1.0]
    assert load_config(path, []).trainer.total_training_steps == 7
    assert len(parsed) == 1
    write(tmp_path, "trainer:\n  total_training_steps: 8\n")
    assert load_config(path, []).trainer.total_training_steps == 8
