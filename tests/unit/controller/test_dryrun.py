"""`megarl train --dry-run`: the printed plan of the Qwen2-7B config, its fit check, and the
quickstart's plan (tiny model absent). Real CLI calls; nothing is started."""
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from megarl.backends.megatron.model import ModelArgs
from megarl.cli import main
from megarl.config import load_config
from megarl.controller import dryrun
from megarl.weight_sync.buckets import plan_buckets

REPO = Path(__file__).resolve().parents[3]
QWEN2 = str(REPO / "configs" / "qwen2_7b_async.yaml")
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
HF_JSON = REPO / "configs" / "models" / "qwen2_7b.json"
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the config's hf_config_path is relative to the working directory


def _dry_run(capsys, *extra) -> tuple[int, str, str]:
    rc = main(["train", "--config", QWEN2, "--dry-run", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def qwen2_out() -> str:
    """The default Qwen2-7B plan, printed once for the tests that read it."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.chdir(REPO):
        assert main(["train", "--config", QWEN2, "--dry-run"]) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def hf_meta():
    """Qwen2-7B's HF parameters from transformers itself, on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(HF_JSON))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_qwen2_placement_servers_and_ranks(qwen2_out):
    out = qwen2_out
    assert "trainer (logp+actor-train): TP4 × PP1 × DP4" in out
    assert "reference (ref_logp): TP4 × PP1 × DP2" in out
    servers = re.findall(r"server (\d): node 3, GPUs (\d)-(\d), base_gpu_id (\d)", out)
    assert [(int(i), int(a), int(b), int(g)) for i, a, b, g in servers] == \
        [(i, 2 * i, 2 * i + 1, 2 * i) for i in range(4)]
    commands = [line for line in out.splitlines() if "-m sglang.launch_server" in line]
    assert len(commands) == 4
    for i, cmd in enumerate(commands):
        assert "--tp-size 2" in cmd and f"--base-gpu-id {2 * i}" in cmd
        assert "--model-path models/Qwen2-7B-Instruct" in cmd and "--load-format dummy" in cmd
    assert "world 9, rank_offsets [1, 3, 5, 7]" in out
    assert out.count("megarl-weights-pp") == 1


def _shipped_plan(capsys, config: str, model_json: str, *extra: str):
    """Dry-run configs/`config` (it must exit 0): (its output, its ModelArgs, the planned
    tensor shapes by name, transformers' parameters of configs/models/`model_json` on the
    meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(REPO / "configs" / config)
    assert main(["train", "--config", path, "--dry-run", *extra]) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(REPO / "configs" / "models" / model_json))
    a = ModelArgs.from_hf(dryrun.load_hf_config(load_config(path, []))[0])
    planned = {s.name: s.shape for stage in dryrun.stage_specs(a, 1, "bfloat16")
               for s in stage}
    return out, a, planned, dict(model.named_parameters())


def test_qwen3_8b_plan_sends_every_tensor_transformers_has(capsys):
    """configs/qwen3_8b_async.yaml: the dry run exits 0, and its plan names every parameter of
    transformers' Qwen3-8B (q_norm / k_norm included) with its shape, and nothing else."""
    out, a, planned, params = _shipped_plan(capsys, "qwen3_8b_async.yaml", "qwen3_8b.json")
    want = {n: tuple(p.shape) for n, p in params.items()}
    assert a.qk_norm and a.head_dim == 128 and not a.qkv_bias
    assert planned == want
    assert f"stage 0 (layers 0-35): {len(want)} tensors" in out
    assert "trainer (logp+actor-train): TP4 × PP1 × DP4" in out


def test_deepseek_v3_671b_plan_sends_every_tensor_and_counts_mla(capsys):
    """configs/deepseek_v3_671b.yaml: the dry run exits 0 and fits 179 GiB GPUs; its plan
    names every checkpoint tensor of transformers' DeepSeek-V3 (MLA's latent projections and
    norms, experts per expert, the fp32 correction bias) with its shape; the engine's KV cache
    is MLA's latent one (61 × (512 + 64) bf16 a token on every TP rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.controller.memory import kv_bytes_per_token
    from megarl.rollout.weights import expert_views

    out, a, planned, params = _shipped_plan(capsys, "deepseek_v3_671b.yaml",
                                            "deepseek_v3_671b.json", "--gpu-memory-gib", "179")
    views = expert_views(params)
    fused = {n for n, p in params.items() if p.dim() == 3}
    want = {n: tuple(p.shape) for n, p in {**params, **views}.items() if n not in fused}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(REPO / "configs" / "models" / "deepseek_v3_671b.json"))
    want.update({n: tuple(b.shape) for n, b in model.named_buffers()
                 if n.endswith("e_score_correction_bias")})
    assert planned == want
    assert "kv_a_proj_with_mqa" in " ".join(want) and len(views) == 58 * 256 * 3
    assert kv_bytes_per_token(a, 8, 2) == 61 * 576 * 2
    assert "multi-latent attention (q/kv latents 1536/512, qk 128+64 rope, v 128)" in out
    assert "experts EP64 × ETP1: 4 of 256 per EP rank, expert-DP2" in out


def test_kimi_k2_config_json_dry_runs_as_deepseek_v3(capsys):
    """Kimi-K2's config.json (model_type kimi_k2, DeepSeek-V3's architecture: 384 experts in
    one group, 64 heads, one dense layer) in the DeepSeek-V3 job: accepted and planned (1T
    parameters: experts over EP128, and 288 GiB GPUs for its bf16 engines)."""
    kimi = REPO / "configs" / "models" / "kimi_k2_1t.json"
    path = str(REPO / "configs" / "deepseek_v3_671b.yaml")
    assert main(["train", "--config", path, "--dry-run", "--gpu-memory-gib", "288",
                 f"actor_rollout_ref.model.hf_config_path={kimi}",
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size=128"]) == 0
    out = capsys.readouterr().out
    assert "model: deepseek_v3, 61 layers, hidden 7168, 64 heads, multi-latent" in out
    assert "experts EP128 × ETP1: 3 of 384 per EP rank" in out


def test_qwen3_30b_a3b_plan_sends_every_expert_stock_sglang_loads(capsys):
    """configs/qwen3_30b_a3b_async.yaml (MoE, 128 experts): the dry run exits 0 and fits, and
    its plan names every checkpoint tensor of transformers' Qwen3-30B-A3B with its shape:
    the fused experts transformers holds, named per expert as checkpoints and stock SGLang
    name them (megarl.rollout.weights.expert_views)."""
    from megarl.rollout.weights import expert_views

    out, a, planned, params = _shipped_plan(capsys, "qwen3_30b_a3b_async.yaml",
                                            "qwen3_30b_a3b.json")
    views = expert_views(params)
    fused = {n for n, p in params.items() if p.dim() == 3}
    want = {n: tuple(p.shape) for n, p in {**params, **views}.items() if n not in fused}
    assert len(views) == 48 * 128 * 3 and len(fused) == 48 * 2
    assert a.is_moe and a.num_experts == 128 and a.moe_topk == 8 and a.norm_topk_prob
    assert planned == want
    assert f"stage 0 (layers 0-47): {len(want)} tensors" in out
    # Expert parallelism 8 (ETP1) on both Megatron models: the trainer's 16 GPUs hold two
    # replicas of every expert, the reference's 8 one; the trainer's attention is verl's
    # recipe layout, TP2 with sequence parallelism × CP2, so 4 data-parallel replicas
    assert "trainer (logp+actor-train): TP2 + SP × CP2 × PP1 × DP4, bfloat16, distributed " \
        "optimizer; experts EP8 × ETP1: 16 of 128 per EP rank, expert-DP2" in out
    assert "reference (ref_logp): TP4 × PP1 × DP2, bfloat16; experts EP8 × ETP1: 16 of 128 " \
        "per EP rank, expert-DP1" in out
    assert "128 experts (top-8, ffn 768)" in out


def test_glm45_355b_plan_sends_every_tensor_stock_sglang_loads(capsys):
    """configs/glm45_355b.yaml (GLM-4.5: 3 dense layers, then 160 routed experts and a shared
    one, sigmoid routing with a correction bias): the dry run exits 0 and fits 141 GiB GPUs,
    and its plan names every checkpoint tensor of transformers' GLM-4.5 (its parameters, the
    experts per expert, and the correction-bias buffer in fp32) with its shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.rollout.weights import expert_views

    out, a, planned, params = _shipped_plan(capsys, "glm45_355b.yaml", "glm45_355b.json",
                                            "--gpu-memory-gib", "141")
    views = expert_views(params)
    fused = {n for n, p in params.items() if p.dim() == 3}
    want = {n: tuple(p.shape) for n, p in {**params, **views}.items() if n not in fused}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(REPO / "configs" / "models" / "glm45_355b.json"))
    biases = {n: tuple(b.shape) for n, b in model.named_buffers()
              if n.endswith("e_score_correction_bias")}
    assert len(biases) == 92 - 3 and len(views) == 89 * 160 * 3
    want.update(biases)
    assert (a.first_k_dense, a.num_experts, a.moe_shared_ffn_hidden_size,
            a.moe_score_function, a.moe_scaling_factor, a.rotary_percent) == (
        3, 160, 1536, "sigmoid", 2.5, 0.5)
    assert planned == want
    specs = [s for stage in dryrun.stage_specs(a, 1, "bfloat16") for s in stage]
    assert {s.dtype for s in specs if s.name in biases} == {"float32"}
    assert "trainer (logp+actor-train): TP8 + SP × PP4 × DP2" in out
    assert "experts EP16 × ETP1: 10 of 160 per EP rank" in out
def test_moe_placement_at_tp2_ep8_with_sequence_parallelism(capsys):
    """The trainer of configs/qwen3_30b_a3b_async.yaml at TP2 with sequence parallelism (how
    an MoE trains under TP) and no CP: attention over TP2 × DP8, the experts folded over the
    same 16 ranks as EP8 × ETP1, two replicas of each; the placement line says SP is on."""
    path = str(REPO / "configs" / "qwen3_30b_a3b_async.yaml")
    m = "actor_rollout_ref.actor.megatron"
    assert main(["train", "--config", path, "--dry-run", f"{m}.tensor_model_parallel_size=2",
                 f"{m}.sequence_parallel=true", f"{m}.context_parallel_size=1"]) == 0
    out = capsys.readouterr().out
    assert "trainer (logp+actor-train): TP2 + SP × PP1 × DP8, bfloat16, distributed " \
        "optimizer; experts EP8 × ETP1: 16 of 128 per EP rank, expert-DP2" in out
    # the reference keeps its own layout (TP4 without SP: it does not train)
    assert "reference (ref_logp): TP4 × PP1 × DP2, bfloat16; experts" in out
    assert "megatron.sequence_parallel" in out  # the activation line's formula


def test_expert_layout_errors_name_the_config_key(capsys):
    """The converter's EP check, worded with the config's key and the model's source."""
    rc, _, err = _dry_run(capsys, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2")
    assert rc == 2
    assert ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2: expert parallelism "
            "needs a mixture-of-experts model, but configs/models/qwen2_7b.json is a dense "
            "qwen2") in err


def test_qwen2_tensors_match_transformers(hf_meta):
    cfg = load_config(QWEN2, [])
    hf, _ = dryrun.load_hf_config(cfg)
    a = ModelArgs.from_hf(hf)
    for pp in (1, 2):
        specs = [s for stage in dryrun.stage_specs(a, pp, "bfloat16") for s in stage]
        assert {s.name: s.shape for s in specs} == hf_meta


_EXPORT = """
import json, os, sys, torch.distributed as dist
from megatron.core import parallel_state as ps
from megarl.backends.megatron import _patches
from megarl.backends.megatron.model import (ModelArgs, MoESettings, build_gpt_model,
                                            transformer_config)
from megarl.controller.dryrun import stage_specs
from megarl.backends.megatron.hf.live import export_hf
from megarl.backends.megatron.parallel import rank_program
port, hf, ep, rank = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with rank_program():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=ep)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    _patches.apply()
    a = ModelArgs.from_hf(hf)
    model = build_gpt_model(a, transformer_config(a, 1, 1, "bfloat16", MoESettings(ep=ep)))
    real = [(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in export_hf(model, a)]
    planned = [(s.name, s.dtype, s.shape) for s in stage_specs(a, 1, "bfloat16", ep)[0]]
    if rank == 0:
        print(real == planned, real, planned)
"""

_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.parametrize("extra,ep", [({"architectures": ["Qwen2ForCausalLM"]}, 1),
                                      # Qwen3: per-head q/k norms, head_dim apart from hidden
                                      ({"architectures": ["Qwen3ForCausalLM"], "head_dim": 24}, 1),
                                      # each rank's local expert i gathered over EP: 0, 2, 1, 3
                                      # (EP=1 is the same walk with one rank: the next test)
                                      (_MOE, 2)],
                         ids=["qwen2", "qwen3", "qwen3_moe_ep2"])
def test_planned_tensors_are_what_megatron_exports(extra, ep):
    """Names, order and dtypes of the planned specs are what the producer really sends (a
    Megatron model of `ep` ranks in subprocesses, so no process group leaks into this one)."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    hf = {"vocab_size": 300, "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "tie_word_embeddings": False, **extra}
    procs = [subprocess.Popen([sys.executable, "-c", _EXPORT, str(port), json.dumps(hf),
                               str(ep), str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(ep)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert outs[0][0].startswith("True"), outs[0][0]


def test_expert_export_order_follows_ep():
    """Each EP rank holds L = 4 / EP consecutive experts; the export walks the local index and
    gathers it over EP, fc1 (gate, up) of those experts before their fc2 (down)."""
    a = ModelArgs.from_hf({**_MOE, "vocab_size": 300, "hidden_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "intermediate_size": 128})

    def experts(ep):
        names = [s.name for s in dryrun.stage_specs(a, 1, "bfloat16", ep)[0]
                 if ".experts." in s.name]
        return [n.split("mlp.experts.")[1].replace("_proj.weight", "") for n in names]

    assert experts(1) == [f"{e}.{x}" for e in range(4) for x in ("gate", "up", "down")]
    assert experts(2) == ["0.gate", "0.up", "2.gate", "2.up", "0.down", "2.down",
                          "1.gate", "1.up", "3.gate", "3.up", "1.down", "3.down"]
    assert experts(4) == [f"{e}.{x}" for e in range(4) for x in ("gate", "up")] + \
        [f"{e}.down" for e in range(4)]


def test_qwen2_buckets_and_memory(qwen2_out, hf_meta):
    out = qwen2_out
    cfg = load_config(QWEN2, [])
    a = ModelArgs.from_hf(dryrun.load_hf_config(cfg)[0])
    (specs,) = dryrun.stage_specs(a, 1, "bfloat16")
    buckets = plan_buckets(specs, 128 * MiB)
    assert f"{len(specs)} tensors, {len(buckets)} bucket(s)" in out
    assert f"largest {max(b.nbytes for b in buckets) / MiB:.1f} MiB" in out

    # Trainer, TP4: matrices (and QKV biases) split four ways, norm weights replicated.
    norms = sum(n for name, s in hf_meta.items() if "norm" in name for n in s)
    total = sum(torch.Size(s).numel() for s in hf_meta.values())
    n = (total - norms) // 4 + norms
    seq = 1024 + 2048
    # logp micro-batch 16 dominates the activations: its log-prob path holds the bf16 logits
    # (half an fp32 copy), z = logits.float() / T, z - max and exp(z - max): 3.5 fp32 copies
    logits = int(3.5 * seq * 16 * (152064 // 4) * 4)
    hf_bytes = (total - norms) * 2 + norms * 4  # bf16, norm weights fp32
    # the dual buffer's snapshot on the sender's GPU: the whole (single) stage
    trainer = n * 2 + n * 4 + n * 12 // 4 + logits + hf_bytes
    assert f"group 'logp+actor-train': {trainer / GiB:.2f} GiB of 80.00 GiB" in out
    assert f"group 'ref_logp': {(n * 2 + logits) / GiB:.2f} GiB" in out
    weights = hf_bytes // 2
    assert re.search(rf"rollout weights/TP2 +{weights / GiB:.2f} GiB", out)
    assert f"group 'generate': {0.85 * 80:.2f} GiB" in out


def test_token_budgets_size_the_micro_batches(capsys, qwen2_out):
    """use_dynamic_bsz: the reference's logits are those of the token budget (8192 tokens,
    not 16 rows × 3072); the trainer's activations shrink too."""
    rc, out, _ = _dry_run(capsys, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192")
    assert rc == 0

    def group_gib(text, name):
        return float(re.search(rf"group '{re.escape(name)}': ([0-9.]+) GiB", text).group(1))

    # the log-prob path's 3.5 fp32 [tokens, V/TP] copies (bf16 logits), TP4
    saved = 3.5 * (16 * 3072 - 8192) * (152064 // 4) * 4 / GiB
    assert group_gib(qwen2_out, "ref_logp") - group_gib(out, "ref_logp") == \
        pytest.approx(saved, abs=0.01)
    assert group_gib(out, "logp+actor-train") < group_gib(qwen2_out, "logp+actor-train") - 1


def test_pipeline_stages_get_their_own_update_group(capsys):
    rc, out, _ = _dry_run(capsys, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2")
    assert rc == 0
    assert "megarl-weights-pp0: world 9, rank_offsets [1, 3, 5, 7]" in out
    assert "megarl-weights-pp1: world 9, rank_offsets [1, 3, 5, 7]" in out
    assert "stage 0 (layers 0-13)" in out and "stage 1 (layers 14-27)" in out


def test_too_small_a_gpu_exits_2_naming_the_group(capsys):
    rc, out, err = _dry_run(capsys, "--gpu-memory-gib", "1")
    assert rc == 2 and out == ""
    assert "group 'logp+actor-train' does not fit" in err and "capacity 1.00 GiB" in err
    rc, _, err = _dry_run(capsys, "actor_rollout_ref.rollout.gpu_memory_utilization=0.05")
    assert rc == 2
    assert "group 'generate' does not fit" in err and "gpu_memory_utilization=0.05" in err


def test_missing_hf_config_exits_2(capsys):
    rc, _, err = _dry_run(capsys, "actor_rollout_ref.model.hf_config_path=nowhere.json")
    assert rc == 2 and "actor_rollout_ref.model.hf_config_path" in err


def test_server_urls_and_torchrun(capsys, monkeypatch):
    rc, out, _ = _dry_run(capsys, "trainer.launcher=torchrun",
                          "actor_rollout_ref.rollout.server_urls=[http://h0:30000,http://h1:30000]")
    assert rc == 0
    assert "none launched" in out and "engine 1: http://h1:30000" in out
    assert "sglang.launch_server" not in out and "world 5, rank_offsets [1, 3]" in out
    monkeypatch.setenv("RANK", "3")  # under torchrun only rank 0 prints the plan
    assert _dry_run(capsys, "trainer.launcher=torchrun")[:2] == (0, "")


def test_quickstart_plans_from_the_tiny_model(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # outputs/tiny-qwen2 is absent here
    assert main(["train", "--config", QUICKSTART, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tiny qwen2 model" in out and "vocab 300, tied embeddings" in out
    assert "-m megarl.rollout.server" in out and "world 2, rank_offsets [1]" in out
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing


def test_sequence_parallelism_shards_the_layers_activations_over_tp():
    """Per layer the norms' share, s·b·6h·e (their inputs, normalised inputs and outputs), is
    whole on every TP rank without sequence parallelism and split over TP with it; with full
    recompute the kept layer inputs shrink by TP too."""
    from megarl.controller import memory

    a = ModelArgs.from_hf(dryrun.load_hf_config(load_config(QWEN2, []))[0])
    M = "actor_rollout_ref.actor.megatron"

    def train_bytes(*extra):  # the logp pass of one row stays under the train pass
        cfg = load_config(QWEN2, ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                                  f"{M}.tensor_model_parallel_size=4",
                                  "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                                  *extra])
        return memory._activation_bytes(cfg, a), cfg

    plain, cfg = train_bytes()
    sp, _ = train_bytes(f"{M}.sequence_parallel=true")
    sbh = memory.micro_batch_tokens(cfg, "actor") * a.hidden_size
    e = 2  # bfloat16
    assert plain - sp == pytest.approx(a.num_layers * sbh * 6 * (1 - 1 / 4) * e, rel=1e-9)
    ckpt = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    assert train_bytes(ckpt, f"{M}.sequence_parallel=true")[0] < train_bytes(ckpt)[0]
    one = train_bytes(f"{M}.tensor_model_parallel_size=1", f"{M}.sequence_parallel=true")[0]
    assert one == train_bytes(f"{M}.tensor_model_parallel_size=1")[0]  # ignored at TP=1


def test_context_parallelism_divides_activations_and_budgets_count_per_rank():
    """CP: one rank holds s·b/CP tokens of a micro-batch (the activations and logits shrink
    by CP), plus the K/V it gathered of the whole sequence(s); a token budget counts per CP
    rank; a group whose devices TP×PP×CP does not divide is refused, naming the key."""
    from megarl.config import ConfigError
    from megarl.controller import memory

    a = ModelArgs.from_hf(dryrun.load_hf_config(load_config(QWEN2, []))[0])
    M = "actor_rollout_ref.actor.megatron"
    base = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false"]

    def train_bytes(*extra):
        return memory._activation_bytes(load_config(QWEN2, [*base, *extra]), a)

    cfg = load_config(QWEN2, base)
    one, two = train_bytes(), train_bytes(f"{M}.context_parallel_size=2")
    tp, e = cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size, 2
    tokens = memory.micro_batch_tokens(cfg, "actor")
    kv = a.num_layers * tokens * 2 * max(1, a.num_heads // tp) * a.head_dim * e
    assert two == pytest.approx(one / 2 + kv, rel=1e-6)
    assert two < 0.6 * one
    budget = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192"]
    cp2 = load_config(QWEN2, [*budget, f"{M}.context_parallel_size=2"])
    assert memory.micro_batch_tokens(cp2, "actor", 2) == 8192  # per CP rank
    with pytest.raises(ConfigError, match="context_parallel_size=3"):
        load_config(QWEN2, [f"{M}.context_parallel_size=3"])


def _activations_gib(out: str) -> float:
    return float(re.search(r"trainer activations +([\d.]+) GiB", out).group(1))


def test_long_response_config_fits_at_cp4_and_cp_saves_its_activations(capsys):
    """configs/qwen3_8b_long_cp.yaml (Qwen3-8B, 32k-token responses): the dry run exits 0 at
    TP4 + SP × CP4 with a per-CP-rank token budget, and its memory lines show what CP saves:
    the same run at CP1 (each micro-batch a whole 33,792-token sequence) plans three to four
    times the activations."""
    path = str(REPO / "configs" / "qwen3_8b_long_cp.yaml")
    assert main(["train", "--config", path, "--dry-run"]) == 0
    cp4 = capsys.readouterr().out
    assert "trainer (logp+actor-train): TP4 + SP × CP4 × PP1 × DP1, bfloat16" in cp4
    assert "--context-length 33792" in cp4
    assert main(["train", "--config", path, "--dry-run",
                 "actor_rollout_ref.actor.megatron.context_parallel_size=1"]) == 0
    cp1 = capsys.readouterr().out
    assert "TP4 + SP × PP1 × DP4" in cp1
    # the whole sequence on each rank against a quarter of it, plus the gathered K/V at CP4
    assert 2.5 < _activations_gib(cp1) / _activations_gib(cp4) < 4
    # the distributed optimizer shards over DP × CP either way: the same state per GPU
    state = re.compile(r"trainer optimizer \(12 B/param / 4\) +([\d.]+) GiB")
    assert state.search(cp4).group(1) == state.search(cp1).group(1)
