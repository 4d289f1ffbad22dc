"""PPO with a critic (`algorithm.adv_estimator=gae`) end to end: the value loss falls, in
the synchronous pipeline with the critic on its own task group (checkpointed and resumed),
and in the async one-step-off pipeline with the critic beside actor-train, KL in the reward
and a critic warm-up."""
from launch_helpers import SCRIPTS
from test_train_e2e import _args, megarl, scalars

GAE = ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
       "critic.optim.lr=3e-3", "critic.optim.weight_decay=0.0", "critic.cliprange_value=0.5",
       f"reward.reward_fn={SCRIPTS / 'offset_reward.py'}:compute_score",
       "trainer.test_freq=-1", "trainer.val_before_train=False"]


def _falls(vf: dict) -> tuple[float, float]:
    steps = sorted(vf)
    first, last = vf[steps[0]], sum(vf[s] for s in steps[-3:]) / 3
    # from a zero head: 0.5 * mean((0 - R)^2) with returns R near 1 (the offset reward)
    assert first > 0.3, vf
    assert last < 0.35 * first, vf
    return first, last


def test_critic_on_its_own_group_sync_then_resume(quickstart_assets, tmp_path):
    own = ["trainer.separated_node_tasks=[[logp,actor-train,ref_logp,generate],[critic]]",
           "trainer.separated_node_ratios=[0.5,0.5]", "trainer.n_gpus_per_node=2",
           "actor_rollout_ref.async_pipeline=False", "trainer.save_freq=4"]
    out = megarl("train", _args(quickstart_assets, tmp_path, *GAE, *own,
                                "trainer.total_training_steps=8"))
    assert "critic model: 1 process(es) on group critic" in out
    vf = scalars(tmp_path, "critic/vf_loss")
    assert sorted(vf) == list(range(1, 9)), out[-2000:]
    first, _ = _falls(vf)
    ckpt = tmp_path / "megarl" / "t" / "global_step_8" / "critic"
    assert (ckpt / "megarl_meta.json").is_file()
    # the PPO loss ran on GAE advantages (whitened: nonzero, finite)
    assert all(v == v for v in scalars(tmp_path, "actor/pg_loss").values())
    # resume: the critic comes back trained (a fresh head would start near `first` again)
    out = megarl("train", _args(quickstart_assets, tmp_path, *GAE, *own,
                                "trainer.total_training_steps=10"))
    assert "resuming after step 8 " in out and "training continues at step 9/10" in out
    vf = scalars(tmp_path, "critic/vf_loss")
    assert vf[9] < 0.35 * first, vf


def test_critic_beside_actor_train_async_kl_in_reward_warmup(quickstart_assets, tmp_path):
    # every pass (logp, ref, values, actor and critic training) in packed micro-batches
    extra = ["trainer.total_training_steps=8", "trainer.save_freq=-1",
             "trainer.critic_warmup=2", "algorithm.use_kl_in_reward=True",
             "algorithm.kl_penalty=low_var_kl", "actor_rollout_ref.actor.use_kl_loss=False",
             "actor_rollout_ref.actor.use_dynamic_bsz=true",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128"]
    out = megarl("train", _args(quickstart_assets, tmp_path, *GAE, *extra))
    # the quickstart's layout: one-step-off, the critic on the trainer's group
    assert "critic model: 1 process(es) on group logp+actor-train+ref_logp" in out
    assert max(scalars(tmp_path, "rollout/staleness_max").values()) == 1
    _falls(scalars(tmp_path, "critic/vf_loss"))
    warm = scalars(tmp_path, "critic/warmup")
    assert [warm[s] for s in sorted(warm)] == [1.0, 1.0] + [0.0] * 6
    # the actor does not train during the warm-up: no actor metrics for steps 1 and 2
    assert sorted(scalars(tmp_path, "actor/pg_loss")) == list(range(3, 9))
    assert len(scalars(tmp_path, "reward/kl_penalty")) == 8
    assert set(scalars(tmp_path, "critic/padding_frac").values()) == {0.0}
    assert min(scalars(tmp_path, "critic/micro_batches").values()) >= 2
