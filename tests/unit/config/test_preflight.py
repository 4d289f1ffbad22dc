"""preflight: good inputs pass and are left as they were; assets the run makes are not required.

(The bad inputs are in tests/fuzz/test_fuzz_data.py.)
"""
from __future__ import annotations

import json
import os

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.preflight import preflight


def _row(i: int) -> dict:
    return {"data_source": "megarl/quickstart", "reward_model": {"ground_truth": str(i)},
            "prompt": [{"role": "user", "content": f"What is {i} + 0?"}]}


def _cfg(tmp_path, model, *extra):
    return load_config(None, [f"actor_rollout_ref.model.path={model}",
                              f"trainer.default_local_dir={tmp_path / 'runs'}", *extra])


@pytest.fixture()
def data(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = tmp_path / "train.jsonl"
    # A bad row among good ones is skipped (data.bad_rows=skip), not an error.
    train.write_text("\n".join([json.dumps(_row(i)) for i in range(5)] + ["{not json"]) + "\n")
    val = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([_row(i) for i in range(3)]), val)
    return train, val


def test_good_inputs_pass_and_leave_only_the_run_dir(tmp_path, qwen_dir, data):
    train, val = data
    before = {p: p.read_bytes() for p in (train, val)}
    overlong = "data.max_prompt_length=8"  # every prompt is longer, and filtered by default
    for extra in ([], [overlong], ["trainer.resume_mode=disable"]):
        preflight(_cfg(tmp_path, qwen_dir, f"data.train_files={train}",
                       f"data.val_files={val}", *extra))
    run_dir = tmp_path / "runs" / "megarl" / "default"
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # the probe file is gone
    assert {p: p.read_bytes() for p in (train, val)} == before


def test_lengths_are_checked_only_when_they_can_fail(tmp_path, qwen_dir, data):
    train, val = data
    base = [f"data.train_files={train}", f"data.val_files={val}",
            "data.filter_overlong_prompts=False", "data.max_prompt_length=8"]
    preflight(_cfg(tmp_path, qwen_dir, *base, "data.truncation=left"))
    with pytest.raises(ConfigError, match=rf"{train}:1: prompt: prompt is \d+ tokens"):
        preflight(_cfg(tmp_path, qwen_dir, *base, "data.truncation=error"))


def test_quickstart_assets_the_run_makes_are_not_required(tmp_path):
    cfg = _cfg(tmp_path, tmp_path / "tiny", "actor_rollout_ref.model.make_tiny=qwen2",
               "data.synthetic_task=quickstart", f"data.train_files={tmp_path}/d/train.jsonl",
               f"data.val_files={tmp_path}/d/val.jsonl")
    preflight(cfg)
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "d" / "train.jsonl").exists()
    # Without make_tiny the same missing model is an error.
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path: no such model"):
        preflight(_cfg(tmp_path, tmp_path / "tiny", "data.synthetic_task=quickstart",
                       f"data.train_files={tmp_path}/d/train.jsonl"))


def test_resume_path_with_a_driver_state_passes(tmp_path, qwen_dir, data):
    step = tmp_path / "runs" / "megarl" / "default" / "global_step_2"
    step.mkdir(parents=True)
    (step / "driver_state.json").write_text(json.dumps({"step": 2, "loader": {}}))
    preflight(_cfg(tmp_path, qwen_dir, f"data.train_files={data[0]}",
                   "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}"))


def test_transformer_engine_asked_for_where_it_is_missing_or_cannot_run(tmp_path, qwen_dir, data):
    import importlib.util

    train, val = data
    key = "actor_rollout_ref.actor.megatron.transformer_impl"
    with pytest.raises(ConfigError, match=rf"^{key}: transformer_engine runs on CUDA only, but "
                                          r"trainer.device=cpu"):
        _cfg(tmp_path, qwen_dir, f"{key}=transformer_engine")
    with pytest.raises(ConfigError, match=r"critic.megatron.transformer_impl: 'fused' is not"):
        _cfg(tmp_path, qwen_dir, "critic.megatron.transformer_impl=fused")
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here: nothing missing to report")
    ref = "actor_rollout_ref.ref.megatron.transformer_impl"
    cfg = _cfg(tmp_path, qwen_dir, "trainer.device=cuda", f"{ref}=transformer_engine",
               f"data.train_files={train}", f"data.val_files={val}")
    with pytest.raises(ConfigError, match=rf"^{ref}: transformer_engine, but Transformer Engine "
                                          "is not installed"):
        preflight(cfg, cuda_devices=1)  # a node with its GPU: the check here is TE's


def test_stock_sglang_without_a_server_python_is_refused_by_key(tmp_path, qwen_dir,
                                                                 monkeypatch):
    """rollout.name=sglang launches stock servers: with no Python that has sglang (no built
    CPU environment, none named, none in megarl's own), the run stops before starting."""
    monkeypatch.setenv("MEGARL_SGLANG_VENV", str(tmp_path / "no-venv"))
    monkeypatch.delenv("MEGARL_SGLANG_PYTHON", raising=False)
    sglang = ["actor_rollout_ref.rollout.name=sglang", "data.synthetic_task=quickstart",
              f"data.train_files={tmp_path / 'd' / 'train.jsonl'}",
              f"data.val_files={tmp_path / 'd' / 'val.jsonl'}"]
    with pytest.raises(ConfigError, match=r"rollout\.server_python.*setup_sglang_env\.sh"):
        preflight(_cfg(tmp_path, qwen_dir, *sglang))
    with pytest.raises(ConfigError, match=r"server_python: /nowhere/python does not exist"):
        preflight(_cfg(tmp_path, qwen_dir, *sglang,
                       "actor_rollout_ref.rollout.server_python=/nowhere/python"))
    import sys
    preflight(_cfg(tmp_path, qwen_dir, *sglang,
                   f"actor_rollout_ref.rollout.server_python={sys.executable}"))
    # servers the user runs need none, but must answer
    with pytest.raises(ConfigError, match=r"server_urls\[0\]: http://127.0.0.1:1 does not "
                                          r"answer /server_info"):
        preflight(_cfg(tmp_path, qwen_dir, *sglang,
                       "actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:1]"))


def test_a_models_experts_are_checked_against_its_expert_layout(tmp_path, qwen_dir,
                                                                  tiny_qwen3_moe, data):
    """The preflight knows the model: EP on a dense model, routing replay on a dense model,
    EP not dividing num_experts and training an MoE under TP without sequence parallelism
    are refused by key; with it, TP2 × EP2 × ETP2 trains."""
    train, val = data
    files = [f"data.train_files={train}", f"data.val_files={val}", "trainer.n_gpus_per_node=8",
             "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],generate]",
             "trainer.separated_node_ratios=[0.5,0.5]"]
    arr = "actor_rollout_ref"
    cases = [
        (qwen_dir, [f"{arr}.actor.megatron.expert_model_parallel_size=2"],
         f"{arr}.actor.megatron.expert_model_parallel_size: .*dense"),
        (qwen_dir, [f"{arr}.rollout.enable_rollout_routing_replay=true"],
         f"{arr}.rollout.enable_rollout_routing_replay: routing replay needs a mixture"),
        (tiny_qwen3_moe, ["trainer.n_gpus_per_node=12", f"{arr}.actor.use_kl_loss=true",
                          f"{arr}.ref.megatron.expert_model_parallel_size=3"],
         f"{arr}.ref.megatron.expert_model_parallel_size: .*num_experts=8 is not divisible"),
        (tiny_qwen3_moe, [f"{arr}.actor.megatron.tensor_model_parallel_size=2"],
         f"{arr}.actor.megatron.sequence_parallel: false, but training a mixture of experts "
         f"at {arr}.actor.megatron.tensor_model_parallel_size=2"),
    ]
    for model, extra, match in cases:
        with pytest.raises(ConfigError, match=match):
            preflight(_cfg(tmp_path, model, *files, *extra))
    preflight(_cfg(tmp_path, tiny_qwen3_moe, *files,
                   f"{arr}.actor.megatron.expert_model_parallel_size=4",
                   f"{arr}.ref.megatron.tensor_model_parallel_size=2", f"{arr}.actor.use_kl_loss=true",
                   f"{arr}.ref.megatron.expert_model_parallel_size=2",
                   f"{arr}.rollout.enable_rollout_routing_replay=true",
                   f"{arr}.actor.router_replay.mode=R3"))
    preflight(_cfg(tmp_path, tiny_qwen3_moe, *files,
                   f"{arr}.actor.megatron.tensor_model_parallel_size=2",
                   f"{arr}.actor.megatron.sequence_parallel=true",
                   f"{arr}.actor.megatron.expert_model_parallel_size=2",
                   f"{arr}.rollout.enable_rollout_routing_replay=true",
                   f"{arr}.actor.router_replay.mode=R3"))


@pytest.mark.parametrize("key,said", [
    ("actor_rollout_ref.model.override_config.num_hidden_layers=4",
     "actor_rollout_ref.model.override_config: applied only when planning"),
    ("actor_rollout_ref.model.hf_config_path=/x/config.json",
     "actor_rollout_ref.model.hf_config_path: read only when planning")])
def test_planning_only_keys_are_refused_by_a_run(tmp_path, qwen_dir, data, key, said):
    """A run builds its models from the model's own config.json: these keys, which only the
    dry run reads, would change nothing there."""
    train, val = data
    with pytest.raises(ConfigError, match=said):
        preflight(_cfg(tmp_path, qwen_dir, f"data.train_files={train}",
                       f"data.val_files={val}", key))


def test_a_data_source_without_a_reward_is_refused_naming_file_and_row(tmp_path, qwen_dir, data):
    """With no reward.reward_fn, a data_source the built-ins do not score would fail every
    call and the run would train on failure_score; with a reward_fn it is the function's."""
    train, val = data
    rows = [_row(i) for i in range(5)]
    rows[3]["data_source"] = "my/new_task"
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = (f"data.train_files={train}", f"data.val_files={val}")
    with pytest.raises(ConfigError, match=rf"data.train_files: {train}:4: no built-in reward "
                                          r"for data_source 'my/new_task'"):
        preflight(_cfg(tmp_path, qwen_dir, *args))
    preflight(_cfg(tmp_path, qwen_dir, *args,
                   "reward.reward_fn=megarl.reward.testing:length_score"))


def test_a_run_that_executes_model_code_checks_the_sandbox_first(tmp_path, qwen_dir, data,
                                                                   monkeypatch):
    """Code rows (or the python tool) make preflight run the sandbox's self-check and set its
    caps for the run's processes; a run without model code leaves the sandbox alone."""
    from megarl.config.preflight import _runs_model_code

    for var in ("MEGARL_SANDBOX_MAX_TIME_S", "MEGARL_SANDBOX_MAX_MEMORY_MB",
                "MEGARL_SANDBOX_ALLOW_UNHARDENED"):
        monkeypatch.delenv(var, raising=False)
    train, val = data
    args = (f"data.train_files={train}", f"data.val_files={val}")
    preflight(_cfg(tmp_path, qwen_dir, *args))
    assert "MEGARL_SANDBOX_MAX_TIME_S" not in os.environ
    rows = [_row(i) for i in range(5)]
    rows[2].update(data_source="codecontests",
                   reward_model={"ground_truth": json.dumps([{"input": "", "output": "1"}])})
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = _cfg(tmp_path, qwen_dir, *args, "reward.sandbox.max_time_limit_s=7")
    assert "'codecontests'" in _runs_model_code(cfg, {"codecontests": "train.jsonl:3"})
    try:
        from megarl.reward.sandbox import check

        check()
    except Exception as err:  # noqa: BLE001
        with pytest.raises(ConfigError, match="reward.sandbox: data_source 'codecontests'"):
            preflight(cfg)
        pytest.skip(f"no sandbox on this host ({err}): checked that preflight refuses the run")
    preflight(cfg)
    assert os.environ["MEGARL_SANDBOX_MAX_TIME_S"] == "7.0"
    tool = _cfg(tmp_path, qwen_dir, "actor_rollout_ref.rollout.multi_turn.enable=true",
                "actor_rollout_ref.rollout.multi_turn.tools=[python]")
    assert "python tool" in _runs_model_code(tool, {})
    with pytest.raises(ConfigError, match="reward.sandbox.max_memory_limit_mb"):
        _cfg(tmp_path, qwen_dir, *args, "reward.sandbox.max_memory_limit_mb=0")
