"""Megatron's DDP and optimizer (what GPUs run) on the CPU: the same steps as plain AdamW, at
DP=2 with and without the distributed optimizer and overlapped grad reduce, and at TP=2 with
sequence parallelism (the norms' weight grads summed over TP), a MoE too at TP=2 × EP=2; bf16 and fp16
params with fp32 main params within half-precision tolerance of fp32; a checkpoint resumes
mid-schedule to the same curve, and in the other dtype with a fresh optimizer."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun

STEPS = 5
SCHEDULE = ["actor_rollout_ref.actor.optim.lr=5e-3",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
            "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
            "actor_rollout_ref.actor.optim.min_lr=5e-4"]
M = "actor_rollout_ref.actor.megatron"


def _curve(tmp_path, model, nproc, *overrides, resume_at=0, env=None):
    out = tmp_path / f"curve{len(list(tmp_path.iterdir()))}" / "curve.json"
    out.parent.mkdir()
    torchrun(SCRIPTS / "optim_curve.py", nproc, out, model, STEPS, resume_at, *SCHEDULE,
             *overrides, env=env)
    return read_json(out)


def _same(a, b, tol=1e-5):
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-9), (a, b)
        for k in ("loss", "grad_norm"):
            assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (k, a, b)


@pytest.fixture(scope="module")
def torch_dp1(tmp_path_factory, tiny_qwen2):
    return _curve(tmp_path_factory.mktemp("torch"), tiny_qwen2, 1, f"{M}.optimizer=torch")


def test_schedule_warms_up_then_decays_to_min_lr(torch_dp1):
    lrs = [s["lr"] for s in torch_dp1]
    assert lrs[:2] == pytest.approx([2.5e-3, 5e-3])
    assert lrs[-1] == pytest.approx(5e-4)  # the last step of the schedule trains at min_lr
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))
    losses = [s["loss"] for s in torch_dp1]
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("extra", [
    [],
    [f"{M}.use_distributed_optimizer=true", f"{M}.overlap_grad_reduce=true"],
], ids=["ddp", "distributed-optimizer-overlap"])
def test_megatron_optimizer_at_dp2_equals_adamw_at_dp1(tmp_path, tiny_qwen2, torch_dp1, extra):
    got = _curve(tmp_path, tiny_qwen2, 2, f"{M}.optimizer=megatron", *extra)
    # DP=2 over two halves of the batch: the grad norms (global, after DDP's average) and the
    # learning rates are those of one rank with the whole batch.
    for a, b in zip(torch_dp1, got):
        assert b["update_skipped"] == 0.0
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    torch_dp2 = _curve(tmp_path, tiny_qwen2, 2, f"{M}.optimizer=torch")
    _same(torch_dp2, got)


def test_tp2_with_sequence_parallelism_equals_tp1(tmp_path, tiny_qwen2, torch_dp1):
    """Megatron's sequence parallelism over gloo: every norm sees half the sequence on each
    rank, so its weight grad is right only once finalize_model_grads sums it over TP; the
    losses, grad norms and (through the updates) the weights stay those of TP=1."""
    got = _curve(tmp_path, tiny_qwen2, 2, f"{M}.tensor_model_parallel_size=2",
                 f"{M}.sequence_parallel=true")
    assert all(s["update_skipped"] == 0.0 for s in got)
    _same(torch_dp1, got)


def test_context_parallelism_equals_cp1(tmp_path, tiny_qwen2, torch_dp1):
    """CP=2 × TP=2 with SP, packed: each rank's loss is computed from log-probs gathered over
    the CP group, its gradient flows through its own chunks (and K/V's reduce-scatter);
    Megatron's schedule scales it by CP and DDP averages over DP×CP: the CP=1 step. Two
    16-token rows per packed micro-batch (the budget counts per CP rank). (CP=2 alone,
    padded, measured equal too: the same code without the TP collectives.)"""
    got = _curve(tmp_path, tiny_qwen2, 4, f"{M}.context_parallel_size=2",
                 f"{M}.tensor_model_parallel_size=2", f"{M}.sequence_parallel=true",
                 env={"OPTIM_TOKEN_BUDGET": "16"})
    assert all(s["update_skipped"] == 0.0 for s in got)
    _same(torch_dp1, got)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_at_tp2_ep2_with_sequence_parallelism_equals_tp1(tmp_path, request, arch):
    """Qwen3-MoE and DeepSeek-V3 at TP=2 × EP=2 with sequence parallelism on two ranks
    (Megatron's parallel folding: the experts' EP=2 × ETP=1 over the same ranks as TP=2; four
    experts each) take the steps of one rank with every expert, the load-balancing and z
    losses included: each TP rank routes its half of the sequence, and those losses' token
    statistics and the router's weight grads are the whole sequence's once summed over TP.
    DeepSeek-V3's multi-latent attention: the RoPE key shared by all heads gets every TP
    rank's heads' gradient (_patches._mla_rope_key_grads; without it 1.2% off TP1)."""
    tiny_qwen3_moe = request.getfixturevalue(f"tiny_{arch}")
    losses = [f"{M}.override_transformer_config.moe_aux_loss_coeff=0.01",
              f"{M}.override_transformer_config.moe_z_loss_coeff=0.001"]
    ref = _curve(tmp_path, tiny_qwen3_moe, 1, *losses)
    got = _curve(tmp_path, tiny_qwen3_moe, 2, f"{M}.tensor_model_parallel_size=2",
                 f"{M}.expert_model_parallel_size=2", f"{M}.expert_tensor_parallel_size=1",
                 f"{M}.sequence_parallel=true", *losses)
    assert all(s["update_skipped"] == 0.0 for s in got)
    _same(ref, got)
    for a, b in zip(ref, got):
        # the losses as logged: the load-balancing loss is the TP ranks' shares summed
        for k in ("moe/aux_loss", "moe/z_loss"):
            assert a[k] > 0 and b[k] == pytest.approx(a[k], rel=1e-5), (k, a, b)
        for k in a:
            if k.startswith("moe/expert_load"):
                assert b[k] == pytest.approx(a[k], rel=1e-6), (k, a, b)
    assert ref[-1]["loss"] < ref[0]["loss"], ref  # the steps really move the weights


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_params_track_fp32_within_half_tolerance(tmp_path, tiny_qwen2, torch_dp1, dtype):
    got = _curve(tmp_path, tiny_qwen2, 1, f"{M}.params_dtype={dtype}")
    for a, b in zip(torch_dp1, got):
        # bf16 keeps 8 bits of mantissa; the fp32 main params keep the updates from rounding
        # away, so the curves stay together instead of drifting apart. fp16 goes through
        # Megatron's loss scaler: no step may be skipped for overflow.
        assert abs(a["loss"] - b["loss"]) <= 0.02 * abs(a["loss"]) + 0.02, (torch_dp1, got)
        assert b["update_skipped"] == 0.0, got
    assert got[-1]["loss"] < got[0]["loss"] - 0.1


@pytest.mark.parametrize("saved,loaded", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_a_checkpoint_reads_back_in_the_other_dtype(tmp_path, tiny_qwen2, saved, loaded):
    """A GPU run's bf16 checkpoint resumed by an fp32 CPU run, and the reverse: the weights
    load (cast), the schedule goes on from the step, and the optimizer, whose state has no
    fp32 main params in one dtype and has them in the other, starts fresh."""
    source = _curve(tmp_path, tiny_qwen2, 1, f"{M}.params_dtype={saved}")
    got = _curve(tmp_path, tiny_qwen2, 1, f"{M}.params_dtype={saved}", "--then",
                 f"{M}.params_dtype={loaded}", resume_at=3)
    assert got[3]["loss"] == pytest.approx(source[3]["loss"], rel=0.01, abs=0.01)
    assert [s["lr"] for s in got] == pytest.approx([s["lr"] for s in source], rel=1e-9)
    assert got[4]["loss"] < got[3]["loss"] - 0.1 and got[4]["update_skipped"] == 0.0


@pytest.mark.parametrize("nproc,extra", [
    (1, [f"{M}.params_dtype=bfloat16"]),
    (2, [f"{M}.use_distributed_optimizer=true"]),
], ids=["bf16", "distributed-optimizer-dp2"])
def test_checkpoint_resumes_mid_schedule(tmp_path, tiny_qwen2, nproc, extra):
    whole = _curve(tmp_path, tiny_qwen2, nproc, *extra)
    resumed = _curve(tmp_path, tiny_qwen2, nproc, *extra, resume_at=3)
    # Adam's moments, the fp32 main params and the schedule's position all come back: a
    # fresh optimizer (or bf16 weights without their main params) would leave the curve.
    _same(whole, resumed, tol=1e-6)


def test_pp2_vpp2_equals_pp1_and_resumes(tmp_path, tiny_qwen2):
    """A virtual pipeline (two model chunks per stage, Megatron's interleaved schedule, one
    DDP per chunk, the tied embedding's grads summed between the first stage's first chunk
    and the last stage's last) takes the steps of one rank with the whole model; its
    checkpoint (chunks saved with global layer keys, the per-rank optimizer state) resumes
    mid-schedule on the curve."""
    from megarl.utils.tiny_model import make_tiny_model

    deep = make_tiny_model(tmp_path / "deep", "qwen2", num_layers=4, num_heads=4,
                           num_kv_heads=2, rope_theta=5000.0)
    whole = _curve(tmp_path, deep, 1, f"{M}.optimizer=torch")
    got = _curve(tmp_path, deep, 2, f"{M}.pipeline_model_parallel_size=2",
                 f"{M}.virtual_pipeline_model_parallel_size=2", resume_at=3)
    assert all(s["update_skipped"] == 0.0 for s in got)
    _same(whole, got)
