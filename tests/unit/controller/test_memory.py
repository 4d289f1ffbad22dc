"""The dry run's trainer memory terms (controller/memory.py) against numbers worked out by hand
for one Qwen2-shaped model: hidden 512, 4 layers, 8 heads of 64 (2 KV heads), SwiGLU width
2816, vocabulary 16384, untied; micro-batches of 2 rows × 512 tokens. How these terms compare
with a measured CPU train step: tools/bench_memory_estimate.py (docs/dry_run.md)."""
import ast
import json
from pathlib import Path

import pytest

from megarl.backends.megatron.model import ModelArgs
from megarl.config import load_config
from megarl.controller import dryrun, memory

MiB = 1 << 20
HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
      "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
      "intermediate_size": 2816, "vocab_size": 16384, "tie_word_embeddings": False,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024}
# per layer: q (+bias), k and v (+biases) of 2 × 64, o, gate/up/down, two norms
LAYER = (512 * 512 + 512) + 2 * (128 * 512 + 128) + 512 * 512 + 3 * 512 * 2816 + 2 * 512
N = 2 * 16384 * 512 + 4 * LAYER + 512  # embedding, lm_head, layers, final norm
NORMS = 4 * 2 * 512 + 512
A, M = "actor_rollout_ref", "actor_rollout_ref.actor.megatron"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    (path / "config.json").write_text(json.dumps(HF))
    return str(path), ModelArgs.from_hf(HF)


def _cfg(path: str, *extra: str):
    return load_config(None, [f"{A}.model.path={path}", "data.max_prompt_length=1",
                              "data.max_response_length=511",
                              f"{A}.actor.ppo_micro_batch_size_per_gpu=2",
                              f"{A}.rollout.log_prob_micro_batch_size_per_gpu=2",
                              f"{A}.model.enable_gradient_checkpointing=false",
                              f"{M}.params_dtype=float32", "trainer.n_gpus_per_node=4",
                              "trainer.device=cpu", *extra])


def _items(items) -> dict:
    return {i.label.split(" (")[0]: i.nbytes for i in items}


def test_logit_copies_follow_the_log_prob_path():
    # logits (e/4 of an fp32 copy), z, z - max, then exp / the entropy's p, finite, p·finite
    assert memory.logit_copies(True, True, 4) == 7.25
    assert memory.logit_copies(False, True, 4) == 6.25
    assert memory.logit_copies(True, False, 4) == 4
    assert memory.logit_copies(False, False, 2) == 3.5
    # token-chunked: the logits and their gradient, two fp32 chunks (a quarter of the tokens)
    assert memory.logit_copies(True, True, 4, 0.25) == 2.5
    assert memory.logit_copies(False, True, 2, 4.0) == 2.5  # a chunk is at most the pass


def test_activations_count_the_layers_and_the_log_prob_path(model):
    path, a = model
    per_token = 6 * 512 + 2 * (8 + 2) * 64 + 5 * 2816  # norms, attention (GQA), SwiGLU
    assert memory.layer_activation_elements(a, 1, False) == per_token == 18432
    stack = 4 * 1024 * per_token * 4
    logits = 1024 * 16384 * 4
    assert memory._activation_bytes(_cfg(path), a) == int(stack + 7.25 * logits)
    # TP2 + SP: every term over TP (V/2 is already a multiple of 128)
    tp2 = _cfg(path, f"{M}.tensor_model_parallel_size=2", f"{M}.sequence_parallel=true")
    assert memory._activation_bytes(tp2, a) == int(stack / 2 + 7.25 * logits / 2)
    # full recompute, one layer a group: four kept inputs, and the live layer only in
    # backward, once the log-prob path is freed (here the larger of the two)
    rc = _cfg(path, f"{A}.model.enable_gradient_checkpointing=true")
    assert memory._activation_bytes(rc, a) == int(4 * 1024 * 512 * 4 + 7.25 * logits)
    # PP2, 1F1B: the last stage's two layers beside the log-prob path, or the first stage's
    # two micro-batches of two layers, whichever is larger
    pp2 = _cfg(path, f"{M}.pipeline_model_parallel_size=2")
    assert memory._activation_bytes(pp2, a) == int(max(stack / 2 + 7.25 * logits, stack))


@pytest.mark.parametrize("impl, dist, grads, state", [
    ("megatron", False, N * 4, N * 12),  # fp32 grad buffer; fp32 main params + Adam m, v
    ("megatron", True, N * 4, N * 12 // 4),  # the distributed optimizer over DP4
    ("torch", False, N * 2, N * 2 * 2),  # AdamW on the bf16 params themselves
])
def test_optimizer_state_by_its_real_dtype(model, impl, dist, grads, state):
    path, a = model
    cfg = _cfg(path, f"{M}.params_dtype=bfloat16", f"{M}.optimizer={impl}",
               f"{M}.use_distributed_optimizer={str(dist).lower()}")
    got = _items(memory.trainer_memory(cfg, a, 4))
    assert got["trainer params"] == N * 2
    assert list(got.values())[1:3] == [grads, state]


def test_the_senders_buffers_are_counted_where_they_are_on_the_gpu(model):
    path, a = model
    stages = dryrun.plan_stage_buckets(a, 1, "bfloat16", 8 * MiB)
    hf = (N - NORMS) * 2 + NORMS * 4  # bf16 matrices, fp32 norm weights
    # a GPU run whose engines sit on GPUs of their own (NCCL cannot join two ranks of one GPU)
    gpu = ["trainer.device=cuda", "trainer.separated_node_ratios=[0.5,0.5]",
           "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
           f"{M}.params_dtype=bfloat16"]
    on = [*gpu, f"{A}.rollout.enable_dual_buffer=true"]
    nccl = _items(memory.trainer_memory(
        _cfg(path, *on, f"{A}.rollout.update_group_backend=nccl"), a, 4, stages))
    assert nccl["weight-sync snapshot"] == hf
    gloo = _items(memory.trainer_memory(
        _cfg(path, *on, f"{A}.rollout.update_group_backend=gloo"), a, 4, stages))
    assert not any(k.startswith("weight-sync") for k in gloo)  # host memory
    single = _items(memory.trainer_memory(
        _cfg(path, *gpu, f"{A}.rollout.update_group_backend=nccl"),
        a, 4, stages))
    # no dual buffer: one packing buffer, the largest bucket (the 16 MiB embedding alone)
    assert single["weight-sync packing buffer"] == 16384 * 512 * 2


def test_memory_and_the_dry_run_do_not_import_each_other():
    """The estimate takes its records from plan_records, never from the dry run that calls it."""
    root = Path(memory.__file__).parent
    for name in ("memory.py", "plan_records.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m and m.endswith("dryrun")}, name
