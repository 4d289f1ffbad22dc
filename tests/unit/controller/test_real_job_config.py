"""configs/gsm8k_qwen3_1node.yaml, a real job's config: Qwen3-8B on one node of 8 GPUs, GSM8K
+ MATH parquet in verl's format, GRPO one step off, W&B. On this CPU machine: its dry run
(the real `megarl train --dry-run`) plans it from a config.json of Qwen3-8B's real shape, and
its data files, small ones in the format tools/prepare_data.py writes, pass the start-up
checks a run makes (every row read, every data_source one with a built-in scorer).

What needs the node is said, not faked: the GPU count is the one argument given (8 GPUs
visible, as on the node the config is for; 4 is refused), and the weights are not here (a
dry run never reads them). Seconds: no model is built, nothing is started."""
import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config
from megarl.config.device import check_node_devices

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "configs" / "gsm8k_qwen3_1node.yaml")

# Qwen3-8B's config.json as published with its weights (the facts the plan is made from)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

GSM8K, MATH = "openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"


def _verl_rows(source: str, split: str, items: list[tuple[str, str]]) -> list[dict]:
    """Rows as verl's examples/data_preprocess scripts (and tools/prepare_data.py) write them."""
    instruction = ("Let's think step by step and output the final answer after \"####\"."
                   if source == GSM8K else
                   "Let's think step by step and output the final answer within \\boxed{}.")
    return [{"data_source": source,
             "prompt": [{"role": "user", "content": f"{q} {instruction}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i}}
            for i, (q, a) in enumerate(items)]


@pytest.fixture
def job(tmp_path, monkeypatch):
    """The job's model directory (config.json only) and data tree, the working directory set
    to where data/ lives, and QWEN3_8B pointing at the model, as the config's header says."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    gsm = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether?", "72"),
           ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
            "babysitting. How much did she earn?", "10")]
    math = [("What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}"),
            ("Solve for $x$: $2x + 3 = 13$.", "5")]
    # a full batch (data.train_batch_size: 256) must exist: the run's check refuses less
    gsm += [(f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             str(2 * i + 3)) for i in range(126)]
    math += [(f"Solve for $x$: $x - {i} = {i}$.", str(2 * i)) for i in range(126)]
    for source, name, items in ((GSM8K, "gsm8k", gsm), (MATH, "math", math)):
        for split in ("train", "test"):
            out = tmp_path / "data" / name / f"{split}.parquet"
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(_verl_rows(source, split, items)), out)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QWEN3_8B", str(model))
    return model


def test_the_one_node_qwen3_job_plans_on_cpu(job, capsys):
    assert main(["train", "--config", CONFIG, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (f"model: qwen3, 36 layers, hidden 4096, heads 32/8 kv, ffn 12288, vocab 151936 "
            f"(from {job}/config.json)") in out
    assert "device: cuda, launcher: ray" in out
    assert "group 'logp+actor-train+ref_logp': 4 device(s) 0-3: node 0 GPUs 0-3" in out
    assert "trainer (logp+actor-train): TP4 × PP1 × DP1, bfloat16, distributed optimizer" in out
    assert "reference (ref_logp): TP4 × PP1 × DP1, bfloat16" in out
    assert "rollout (generate): sglang, 2 replica(s) × TP2" in out
    assert out.count(f"--model-path {job} ") == 2 and "--dtype bfloat16" in out
    # the fit check passed for 80 GB GPUs (a plan over capacity exits 2)
    assert "group 'generate': 68.00 GiB of 80.00 GiB" in out


def test_the_one_node_qwen3_job_loads_as_verl_users_expect(job):
    from megarl.config.preflight import _check_data

    cfg = load_config(CONFIG, [])
    assert cfg.actor_rollout_ref.model.path == str(job)  # ${oc.env:QWEN3_8B,...}
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert dict(cfg.data.apply_chat_template_kwargs) == {"enable_thinking": False}
    assert cfg.trainer.generate_ahead_steps == 2 and cfg.actor_rollout_ref.async_pipeline
    assert (cfg.trainer.device, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == \
        ("cuda", 1, 8)
    assert {cfg.actor_rollout_ref.actor.megatron.params_dtype,
            cfg.actor_rollout_ref.ref.megatron.params_dtype,
            cfg.actor_rollout_ref.rollout.dtype} == {"bfloat16"}
    # the run's own start-up read of the data: every row, every source scored by a built-in
    _check_data(cfg, None)
    # the node it is written for has its 8 GPUs; one with 4 is refused before any work
    check_node_devices(cfg, cuda_devices=8)
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node: 8 asked, but this node "
                                          r"has 4 visible CUDA devices"):
        check_node_devices(cfg, cuda_devices=4)
