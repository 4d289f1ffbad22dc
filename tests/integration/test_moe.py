"""A mixture of experts (tiny Qwen3-MoE: 8 experts, top-2) under expert parallelism: the
Megatron model equals transformers at EP=2 × TP=2, and routing replay makes its routers take
the given experts (the log-probs then those of transformers under the same routing); GRPO
runs of a tiny GLM-4.5 (a dense first layer, then sigmoid routing with a correction bias and a
shared expert) and a tiny DeepSeek-V3 (the same kind of MoE in expert groups, behind
multi-latent attention with YaRN) at TP=2 × EP=2 with routing replay learn and send every
expert to the engines bit for bit. (Qwen3-MoE at EP=2 with routing replay trains end to end, restarts and resumes
to the same per-step batches, with its routing cached in checkpoints:
test_train_e2e.py::test_a_lost_trainer_worker_restarts_...)"""
import json
import shutil

import pytest

from launch_helpers import ROOT, SCRIPTS, read_json, torchrun
from test_train_e2e import megarl, scalars


def test_expert_parallel_model_equals_hf_and_replays_routing(tmp_path, tiny_qwen3_moe):
    """EP=2 over the two data-parallel ranks (each runs the same rows; tokens cross to the
    experts' ranks), each expert split over the two TP ranks (ETP = TP). (EP=2 alone: the
    GRPO run's first, on-policy step below.) The same again with sequence parallelism, which
    megatron-core 0.16 needs to train an MoE under TP: equal to transformers, padded and
    packed, replaying a forced routing, and two training steps with replay."""
    out = tmp_path / "moe.json"
    torchrun(SCRIPTS / "moe_replay.py", 4, out, tiny_qwen3_moe, 2)
    r = read_json(out)
    assert r["logits"] <= 1e-4 and r["logprobs"] <= 1e-5 and r["entropy"] <= 1e-5, r
    assert r["own_vs_hf"] == 0, r          # the same weights route the same way
    assert r["forced_vs_own"] > 0.05, r    # the forced routing really is another one
    assert r["forced_not_taken"] == 0, r   # every real token took the replayed experts
    assert r["forced_padded"] <= 1e-5 and r["forced_packed"] <= 1e-5, r
    assert r["ignored_without_replay"] <= 1e-5, r
    assert r["sp_logits"] <= 1e-4, r
    for layout in ("padded", "packed"):
        assert r[f"sp_logprobs_{layout}"] <= 1e-5 and r[f"sp_entropy_{layout}"] <= 1e-5, r
        assert r[f"sp_forced_{layout}"] <= 1e-5, r
    assert r["train_finite"] and "moe/expert_load_max" in r["train_metrics"], r


MOE_KEYS = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _moe_args(assets, run_dir, *extra, arch="glm4_moe"):
    return ["--config", str(ROOT / "configs" / "quickstart.yaml"),
            f"actor_rollout_ref.model.path={assets / 'moe'}",
            f"actor_rollout_ref.model.make_tiny={arch}",
            f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=t",
            # two trainer ranks and two engines; no KL loss, so no reference model (two
            # processes fewer)
            "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.rollout.verify_weight_sync=true",
            "trainer.test_freq=-1", "trainer.val_before_train=False", *extra]


# the tensors a version sends (checksummed on the engines)
TENSORS = {"glm4_moe": 57, "deepseek_v3": 53}


@pytest.mark.parametrize("arch", list(TENSORS))
def test_grpo_at_tp2_ep2_sp_with_routing_replay_learns_and_syncs_experts_exactly(
        quickstart_assets, tmp_path, arch):
    """A tiny GLM-4.5 (`make_tiny: glm4_moe`) or DeepSeek-V3 (`deepseek_v3`) at TP=2 × EP=2 with sequence parallelism on two
    ranks (Megatron's parallel folding: the experts' own layout, EP=2 × ETP=1, spans the same
    two ranks as TP=2; four experts each), three steps ahead, packed micro-batches (the
    allgather dispatcher then needs one packed length on every EP rank, a multiple of TP), the
    engines' routing replayed in LOGP and TRAIN (each TP rank replays its sequence slice; the
    dense layer 0 has no router and its zero-filled routing row is not read)."""
    assets = tmp_path / "assets"
    shutil.copytree(quickstart_assets / "data", assets / "data")
    run = tmp_path / "run"
    out = megarl("train", _moe_args(
        assets, run, "trainer.save_freq=40", "trainer.generate_ahead_steps=3",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        # small router losses, for their metrics (RL runs leave them off)
        f"{MOE_KEYS}.moe_aux_loss_coeff=0.001", f"{MOE_KEYS}.moe_z_loss_coeff=0.001",
        arch=arch))
    assert "actor model: 2 process(es)" in out and "EP=2" in out, out[-3000:]
    assert "TP=2" in out, out[-3000:]
    # step 1 is on-policy (version 0 everywhere): the trainer's log-probs at TP=2 × EP=2 are the
    # engine's (transformers') own
    assert scalars(run, "rollout/logp_mismatch_mean")[1] < 1e-4
    assert min(scalars(run, "actor/micro_batches").values()) >= 2
    reward = scalars(run, "reward/mean")
    assert sorted(reward) == list(range(1, 41)), out[-2000:]
    first = sum(reward[s] for s in range(1, 9)) / 8
    last = sum(reward[s] for s in range(33, 41)) / 8
    assert last > first + 0.1, (first, last)
    # every version reached both engines bit for bit, experts, the shared expert and the fp32
    # correction bias included (checksums per tensor)
    assert out.count(f"{TENSORS[arch]} tensors equal the trainer's") >= 2 * 40, out[-3000:]
    assert "differ" not in out
    # expert load per layer, the busiest expert over the mean: between even and collapsed
    load = scalars(run, "actor/moe/expert_load_max")
    assert sorted(load) == list(range(1, 41)) and all(1.0 <= v <= 4.0 for v in load.values())
    for loss in ("aux_loss", "z_loss"):
        values = scalars(run, f"actor/moe/{loss}")
        assert sorted(values) == list(range(1, 41)) and all(v > 0 for v in values.values())
    meta = json.loads((run / "megarl" / "t" / "global_step_40" / "actor" /
                       "megarl_meta.json").read_text())
    assert (meta["tp"], meta["ep"], meta["etp"]) == (2, 2, 1)
