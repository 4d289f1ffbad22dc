"""The trainers' optimizer settings: Megatron's LR scheduler as configured, and the settings
that cannot run refused by key before any work."""
import math

import pytest

from megarl.backends.megatron.optim import OptimConfig
from megarl.cluster.spec import megatron_spec
from megarl.config import load_config
from megarl.config.errors import ConfigError

A = "actor_rollout_ref.actor"


def test_warm_up_then_constant_keeps_the_old_schedule():
    c = OptimConfig(lr=1e-3, lr_warmup_steps=4)
    assert [c.lr_at(k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert OptimConfig(lr=1e-3).lr_at(0) == pytest.approx(1e-3)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_reaches_min_lr_on_the_last_step(style):
    c = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style=style,
                    lr_decay_steps=10)
    lrs = [c.lr_at(k) for k in range(10)]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])
    for k in range(2, 10):  # step k trains at the schedule after k+1 increments
        ratio = (k + 1 - 2) / (10 - 2)
        coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lrs[k] == pytest.approx(1e-4 + coeff * 9e-4)
    assert lrs[-1] == pytest.approx(1e-4)
    assert c.lr_at(25) == pytest.approx(1e-4)  # past the schedule: min_lr


def test_bad_optimizer_settings_are_refused():
    with pytest.raises(ValueError, match="lr_decay_steps=3"):
        OptimConfig(lr_warmup_steps=3, lr_decay_style="cosine", lr_decay_steps=3)
    with pytest.raises(ValueError, match="min_lr"):
        OptimConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="impl"):
        OptimConfig(impl="sgd")


@pytest.mark.parametrize("overrides,key", [
    ([f"{A}.megatron.optimizer=torch", f"{A}.megatron.use_distributed_optimizer=true"],
     f"{A}.megatron.use_distributed_optimizer"),
    (["critic.megatron.optimizer=torch", "critic.megatron.overlap_grad_reduce=true"],
     "critic.megatron.overlap_grad_reduce"),
    ([f"{A}.optim.lr=1e-5", f"{A}.optim.min_lr=1e-4"], f"{A}.optim.min_lr"),
    ([f"{A}.optim.lr_decay_style=cosine", f"{A}.optim.lr_warmup_steps=5",
      f"{A}.optim.total_training_steps=5"], f"{A}.optim.total_training_steps"),
    ([f"{A}.optim.lr_decay_style=exponential"], f"{A}.optim.lr_decay_style"),
])
def test_config_check_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_a_null_schedule_length_is_the_trainer_total():
    cfg = load_config(None, [f"{A}.optim.lr_decay_style=linear", f"{A}.optim.lr_warmup_steps=3",
                             f"{A}.optim.min_lr=0.0", f"{A}.megatron.use_distributed_optimizer=true",
                             f"{A}.megatron.overlap_grad_reduce=true"])
    optim = megatron_spec(cfg, "actor", schedule_steps=40).model.optim
    assert (optim.lr_decay_steps, optim.lr_decay_style, optim.impl) == (40, "linear", "megatron")
    assert optim.use_distributed_optimizer and optim.overlap_grad_reduce
    # a run too short for its warm-up and decay is refused by key when its length is known
    with pytest.raises(ConfigError, match=rf"{A}\.optim\.lr_warmup_steps=3"):
        megatron_spec(cfg, "actor", schedule_steps=3)
    # the critic's schedule is its own
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "critic.optim.lr_decay_style=cosine",
                             "critic.optim.total_training_steps=7"])
    assert megatron_spec(cfg, "critic", schedule_steps=40).model.optim.lr_decay_steps == 7
