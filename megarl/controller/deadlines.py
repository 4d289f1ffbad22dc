"""The bound on every state of a run: a state still running at its deadline is wedged (a
peer that stopped answering without dying, a collective or an HTTP call waiting on one) and
fails by name, as a lost worker does; `trainer.max_restarts` then restarts the run.

A step's states may each take `trainer.state_timeout_s` plus the step's work at
`trainer.state_min_tokens_per_s`: its tokens (prompts × samples × the longest prompt plus
response the config allows) times the passes a step makes over them (generation, the
reference and proximal log-probs, and each training epoch). Every state gets the whole
step's work because some wait on others legitimately (GENERATE for the weights its step
needs, SYNC for a generation with `sync_between_generations`). A validation gets its own
prompts' tokens. The bound comes from the config, so it is known before the state starts;
deliberately coarse: it is there to turn a hang into an error within a stated time, not to
judge speed. Finer bounds sit below it where the work is known exactly (a weight-sync
bucket's bytes at `weight_sync_min_bandwidth_mbps`, an engine's `/health` answer).
"""
from __future__ import annotations


class StateTimeout(TimeoutError):
    """A state ran past its deadline: something it waits on is wedged."""


def step_tokens(cfg) -> int:
    """Tokens one step handles in all its passes, at most."""
    d, arr = cfg.data, cfg.actor_rollout_ref
    prompts = d.train_batch_size + (arr.rollout.over_sample_prompts or 0)
    epochs = max(arr.actor.ppo_epochs, cfg.critic.ppo_epochs or 0)
    return prompts * arr.rollout.n * (d.max_prompt_length + d.max_response_length) * (3 + epochs)


def validation_tokens(cfg, prompts: int) -> int:
    d = cfg.data
    return prompts * cfg.actor_rollout_ref.rollout.val_kwargs.n * \
        (d.max_prompt_length + d.max_response_length)


def deadline_s(cfg, tokens: int) -> float:
    t = cfg.trainer
    return float(t.state_timeout_s) + tokens / float(t.state_min_tokens_per_s)


def explain(cfg, action, limit: float, tokens: int) -> str:
    t = cfg.trainer
    return (f"{action} did not finish within {limit:.0f} s (trainer.state_timeout_s = "
            f"{t.state_timeout_s:g} s + {tokens} tokens at trainer.state_min_tokens_per_s = "
            f"{t.state_min_tokens_per_s:g}): something it waits on is wedged")
