"""The usage example of ../shared/DESIGN.md §1, verbatim: every key must parse and run."""

DESIGN_OVERRIDES = [
    "+actor_rollout_ref.async_pipeline=True",
    "+trainer.sperated_node_tasks=[[logp,actor-train],ref_logp,generate]",
    "+trainer.sperated_node_ratios=[0.5,0.25,0.25]",
    "+actor_rollout_ref.rollout.enable_dual_buffer=True",
    "+actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb=512",
    "+actor_rollout_ref.rollout.param_update_consume_bucket_size_mb=128",
    "+trainer.generate_ahead_steps=2",
]
