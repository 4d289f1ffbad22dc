"""verl's keys in megarl's loader: the table (megarl/config/verl_keys.tsv) against verl 0.9.1's
YAML, each status's behaviour, the layout and async mappings, and the overrides of verl's own
example scripts. Pure config loading: a few seconds in all."""
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import yaml

from megarl.config import verl_keys
from megarl.config.errors import ConfigError
from megarl.config.loader import _megarl_key, _split_override, load_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = Path(__file__).with_name("data") / "verl_example_overrides.yaml"


def _tool():
    spec = importlib.util.spec_from_file_location("gen_verl_keys", ROOT / "tools" / "gen_verl_keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    mod = _tool()
    if not (Path(mod.DEFAULT_VERL) / "verl").is_dir():
        pytest.fail(f"verl 0.9.1's reference is not installed ({mod.DEFAULT_VERL}): run "
                    "`bash tools/setup_verl_ref.sh`")
    return mod


@pytest.fixture(scope="module")
def composed(tool):
    return tool.compose(tool.DEFAULT_VERL)


def _status(key: str, value) -> str:
    """What the loader makes of one override: works, noted, refused or unknown."""
    key = key.lstrip("+")
    try:
        verl_keys.check_value(key, value)
    except ConfigError:
        return "refused"
    canonical = verl_keys.ALIASES.get(key, key)
    if _megarl_key(canonical):
        return "works"
    row = verl_keys.lookup(canonical)
    if row is None:
        return "unknown"
    if row.status == "refused":  # verl's default is accepted, and does nothing here
        at_default = row.key == canonical and any(verl_keys._same(value, d) for d in row.defaults)
        return "noted" if at_default else "refused"
    return row.status


def test_table_is_current(tool):
    """The committed table is what the tool writes from the wheel's YAML and this schema: a verl
    release that adds a key, or a megarl key added here, fails until the table is regenerated."""
    assert (ROOT / "megarl" / "config" / "verl_keys.tsv").read_text() == tool.table(tool.DEFAULT_VERL), \
        "megarl/config/verl_keys.tsv is stale: run python tools/gen_verl_keys.py"


def test_every_leaf_of_every_config_is_in_the_table(composed):
    counts = {}
    for name, keys in composed.items():
        missing = [k for k in keys if k not in verl_keys.KEYS]
        assert not missing, f"{name}: not in the table: {missing[:5]}"
        counts[name] = verl_keys.counts(name)
        assert sum(counts[name].values()) == len(keys)
    print("\nverl keys per config (works/noted/refused):",
          {n: "/".join(str(c[s]) for s in ("works", "noted", "refused")) for n, c in counts.items()})


def test_each_config_loads_whole_with_verls_defaults(composed):
    """All of a config's keys at once, at verl's values: none is unknown, none refused (the FSDP
    configs' strategy=fsdp aside, which is refused by design and tested below)."""
    for name, keys in composed.items():
        overrides = [f"+{k}={json.dumps(v)}" for k, v in keys.items()
                     if not (isinstance(v, str) and ("${" in v or v == "???"))
                     and not k.endswith(".strategy")]
        cfg = load_config(None, overrides)
        assert cfg.data.train_batch_size == keys["data.train_batch_size"] or "async" in name
        if name != "megatron":  # the recipes' split layout: two groups, generation ahead
            assert cfg.trainer.separated_node_tasks == [["actor-train", "logp", "ref_logp"], "generate"]
            assert cfg.trainer.generate_ahead_steps >= 2


def test_works_keys_reach_their_megarl_setting():
    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.dtype=bfloat16",
                             "+async_training.partial_rollout=true",
                             "actor_rollout_ref.rollout.response_length=7",
                             "actor_rollout_ref.actor.optim.total_training_steps=-1",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                             "custom_reward_function.path=/x/my_reward.py",
                             "custom_reward_function.name=score"])
    assert cfg.actor_rollout_ref.actor.megatron.params_dtype == "bfloat16"
    assert cfg.actor_rollout_ref.rollout.partial_rollout is True
    assert cfg.actor_rollout_ref.rollout.max_new_tokens == 7
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps is None  # verl's -1: derive
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.enable is True
    assert cfg.reward.reward_fn == "/x/my_reward.py:score"
    # a file, in verl's nesting, the same
    with pytest.raises(ConfigError, match="reward.reward_fn"):
        load_config(None, ["reward.reward_fn=a:b", "custom_reward_function.path=/x/r.py"])


def test_noted_keys_warn_once_naming_each(caplog):
    overrides = ["actor_rollout_ref.model.use_remove_padding=false",
                 "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
                 "actor_rollout_ref.actor.profiler.enable=true",
                 "actor_rollout_ref.actor.optim._target_=verl.workers.config.McoreOptimizerConfig"]
    with caplog.at_level(logging.WARNING, logger="megarl.config.verl_keys"):
        load_config(None, overrides)
        load_config(None, overrides)  # the same config again (megarl plan): said once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for key in ("actor_rollout_ref.model.use_remove_padding", "engine_kwargs.sglang.attention_backend",
                "actor_rollout_ref.actor.profiler.enable"):
        assert key in warnings[0]
    assert "megarl always packs sequences" in warnings[0]
    assert "_target_" not in warnings[0]  # verl's own default: nothing to say


@pytest.mark.parametrize("override, reason", [
    ("actor_rollout_ref.rollout.name=vllm", "megarl generates with SGLang"),
    ("actor_rollout_ref.actor.megatron.param_offload=True", "tensor_model_parallel_size"),
    ("+actor_rollout_ref.actor.megatron.grad_offload=True", "gradient offload"),
    ("actor_rollout_ref.actor.strategy=fsdp", "Megatron-core only"),
    ("actor_rollout_ref.actor.megatron.dynamic_context_parallel=true", "static"),
    ("actor_rollout_ref.model.lora_rank=8", "LoRA"),
    ("async_training.use_dynamic_resource_scheduling=true", "fixed for the run"),
])
def test_refused_values_name_the_key_and_why(override, reason):
    key = override.lstrip("+").partition("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(key) and reason in str(err.value)
    default = json.dumps(verl_keys.KEYS[key].defaults[0])
    if verl_keys.KEYS[key].status == "refused":  # verl's default is accepted silently
        load_config(None, [f"{key}={default}"])


def test_one_step_off_layout_maps_to_two_groups():
    # verl's one-node one-step-off: 6 trainer + 2 rollout devices on one node of 8
    cfg = load_config(None, ["trainer.nnodes=1", "trainer.n_gpus_per_node=6",
                             "+rollout.nnodes=1", "+rollout.n_gpus_per_node=2"])
    t = cfg.trainer
    assert (t.nnodes, t.n_gpus_per_node, list(t.separated_node_ratios)) == (1, 8, [0.75, 0.25])
    assert t.generate_ahead_steps == 2 and cfg.actor_rollout_ref.async_pipeline
    # whole nodes: 3 training + 1 rollout node of 8
    cfg = load_config(None, ["trainer.nnodes=3", "trainer.n_gpus_per_node=8",
                             "rollout.nnodes=1", "rollout.n_gpus_per_node=8"])
    assert (cfg.trainer.nnodes, list(cfg.trainer.separated_node_ratios)) == (4, [0.75, 0.25])
    with pytest.raises(ConfigError, match="trainer.separated_node_ratios"):
        load_config(None, ["rollout.nnodes=1", "trainer.separated_node_ratios=[1.0]"])
    with pytest.raises(ConfigError, match="rollout.n_gpus_per_node"):
        load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                           "rollout.nnodes=2", "rollout.n_gpus_per_node=4"])


def test_fully_async_keys_map_to_ahead_steps_and_batch():
    cfg = load_config(None, ["data.train_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             "async_training.staleness_threshold=0.5",
                             "async_training.trigger_parameter_sync_step=2",
                             "async_training.require_batches=3"])
    assert cfg.trainer.generate_ahead_steps == 3  # 1.5 windows ahead: 2 versions at most
    assert cfg.data.train_batch_size == 8 * 3 * 2
    cfg = load_config(None, ["async_training.staleness_threshold=0"])
    assert cfg.trainer.generate_ahead_steps == 2
    with pytest.raises(ConfigError, match="trainer.generate_ahead_steps"):
        load_config(None, ["async_training.staleness_threshold=0", "trainer.generate_ahead_steps=4"])
    with pytest.raises(ConfigError, match="async_training.require_batches"):
        load_config(None, ["async_training.require_batches=0"])


def test_did_you_mean_only_offers_the_same_setting():
    """The issue's misleading suggestions are gone; a typo still gets its key."""
    for override, bad in [("custom_reward_function.path=x.py", "actor_rollout_ref.model.path"),
                          ("foo.path=x", "model.path"),
                          ("actor_rollout_ref.actor.megatron.param_offloads=true", "params_dtype"),
                          ("actor_rollout_ref.model.use_remove_padingg=true", "trust_remote_code")]:
        try:
            load_config(None, [override])
        except ConfigError as err:
            assert bad not in str(err), str(err)
    for override, good in [("actor_rollout_ref.actor.megatron.param_ofload=true",
                            "actor_rollout_ref.actor.megatron.param_offload"),
                           ("actor_rollout_ref.actor.clip_ratoi=0.2", "actor_rollout_ref.actor.clip_ratio"),
                           ("trainer.async_pipeline=true", "actor_rollout_ref.async_pipeline")]:
        with pytest.raises(ConfigError, match=f"did you mean `{good}`"):
            load_config(None, [override])


def test_verl_example_scripts_overrides():
    """Every override of verl's example scripts is known: works, noted, or refused with why."""
    scripts = yaml.safe_load(EXAMPLES.read_text())
    report = {}
    for script, overrides in scripts.items():
        counts = {"works": 0, "noted": 0, "refused": 0, "unknown": 0}
        for text in overrides:
            key, value = _split_override(text)
            counts[_status(key, value)] += 1
        assert counts["unknown"] == 0, (script, counts)
        report[Path(script).name] = counts
    print("\nverl example scripts (works/noted/refused):",
          {n: f"{c['works']}/{c['noted']}/{c['refused']}" for n, c in report.items()})


def test_an_example_script_loads_once_its_refused_values_are_changed():
    """verl's one-step-off Megatron DAPO script, with megarl's answer to each refusal."""
    overrides = yaml.safe_load(EXAMPLES.read_text())[
        "verl/experimental/one_step_off_policy/shell/dapo_7b_math_megatron_4_12.sh"]
    with pytest.raises(ConfigError, match="rollout.name"):
        load_config(None, overrides)
    megarl = {"actor_rollout_ref.rollout.name": "sglang"}
    with pytest.raises(ConfigError, match="rollout.n_gpus_per_node: 2 with trainer.n_gpus_per_node: 6"):
        load_config(None, [f"{k}={megarl[k]}" if (k := _split_override(t)[0]) in megarl else t
                           for t in overrides])
    # 6 + 2 devices on each of 2 nodes is not a megarl layout; whole nodes are: 1 + 1 of 8
    megarl.update({"trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "rollout.nnodes": 1,
                   "rollout.n_gpus_per_node": 8})
    kept = []
    for text in overrides:
        key, value = _split_override(text)
        kept.append(f"{key}={megarl[key]}" if key in megarl else text)
    cfg = load_config(None, kept)
    assert cfg.trainer.nnodes == 2 and list(cfg.trainer.separated_node_ratios) == [0.5, 0.5]
    assert cfg.trainer.generate_ahead_steps == 2
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.enable is True


def test_a_file_in_verls_nesting(tmp_path, caplog):
    """verl's keys nested as verl's YAML nests them, beside megarl's own."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "async_training": {"staleness_threshold": 1, "partial_rollout": True},
        "actor_rollout_ref": {"rollout": {"engine_kwargs": {"sglang": {"attention_backend": "fa3"}},
                                          "temperature": 0.7},
                              "actor": {"megatron": {"param_offload": False}}},
        "rollout": {"nnodes": 1, "n_gpus_per_node": 1},
    }))
    with caplog.at_level(logging.WARNING, logger="megarl.config.verl_keys"):
        cfg = load_config(path)
    assert cfg.trainer.generate_ahead_steps == 3 and cfg.actor_rollout_ref.rollout.partial_rollout
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7
    assert list(cfg.trainer.separated_node_ratios) == [0.5, 0.5]
    assert "engine_kwargs.sglang" in caplog.text and "param_offload" not in caplog.text
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"megatron": {"param_offload": True}}}}))
    with pytest.raises(ConfigError, match=f"param_offload: True is not supported in {path}"):
        load_config(path)


def test_the_layout_given_closer_to_the_run_wins(tmp_path):
    """As the loader's other aliases: an override beats the file, either way round."""
    megarl = tmp_path / "megarl.yaml"
    megarl.write_text("trainer: {n_gpus_per_node: 2, separated_node_tasks: [[generate, ref_logp, "
                      "logp, actor-train]], separated_node_ratios: [1.0]}\n")
    cfg = load_config(megarl, ["trainer.n_gpus_per_node=3", "+rollout.nnodes=1",
                               "+rollout.n_gpus_per_node=1"])
    assert list(cfg.trainer.separated_node_ratios) == [0.75, 0.25]
    verl = tmp_path / "verl.yaml"
    verl.write_text("rollout: {nnodes: 1, n_gpus_per_node: 1}\ntrainer: {n_gpus_per_node: 3}\n")
    cfg = load_config(verl, ["trainer.separated_node_ratios=[1.0]",
                             "trainer.separated_node_tasks=[[generate,ref_logp,logp,actor-train]]"])
    assert list(cfg.trainer.separated_node_ratios) == [1.0] and cfg.trainer.n_gpus_per_node == 3
