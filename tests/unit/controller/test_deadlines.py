"""Every state's deadline (controller/deadlines.py): the floor plus the step's work at the
slowest rate a state may make progress at, and what a state past it says."""
from megarl.config import ConfigError, load_config
from megarl.controller import deadlines

import pytest


def _cfg(*overrides):
    return load_config(None, ["data.train_batch_size=8", "data.max_prompt_length=64",
                              "data.max_response_length=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                              "trainer.state_timeout_s=30", "trainer.state_min_tokens_per_s=50",
                              *overrides])


def test_a_step_bound_counts_every_pass_over_its_tokens():
    cfg = _cfg()
    # 8 prompts x 4 samples x (64 + 8) tokens, over generation, reference, proximal and 1 epoch
    assert deadlines.step_tokens(cfg) == 8 * 4 * 72 * 4
    assert deadlines.deadline_s(cfg, deadlines.step_tokens(cfg)) == 30 + 8 * 4 * 72 * 4 / 50
    more = _cfg("actor_rollout_ref.actor.ppo_epochs=3",
                "actor_rollout_ref.rollout.over_sample_prompts=4")
    assert deadlines.step_tokens(more) == 12 * 4 * 72 * 6
    assert deadlines.validation_tokens(cfg, 32) == 32 * 1 * 72


def test_the_message_names_the_state_its_bound_and_the_keys():
    text = deadlines.explain(_cfg(), "TRAIN(3)@actor-train", 215.0, 9216)
    assert text == ("TRAIN(3)@actor-train did not finish within 215 s (trainer.state_timeout_s"
                    " = 30 s + 9216 tokens at trainer.state_min_tokens_per_s = 50): something "
                    "it waits on is wedged")


@pytest.mark.parametrize("key", ["trainer.state_timeout_s", "trainer.state_min_tokens_per_s"])
def test_bounds_that_are_no_bounds_are_refused_by_key(key):
    with pytest.raises(ConfigError, match=key):
        _cfg(f"{key}=0")
