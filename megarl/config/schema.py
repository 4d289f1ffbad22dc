"""The megarl configuration schema: omegaconf structured dataclasses in the verl layout.

This module owns the *shape* of the config: every key, its type, its default and what it
means (the string under each field). Defaults are small and CPU-friendly so that the bare
schema, with no YAML and no overrides, validates. Cross-field rules (ratios summing to one,
TP dividing a group, ...) live in ``validate.py``; loading, overrides and aliases in
``loader.py``. ``CHOICES`` lists the allowed values of the string-enum fields (plain ``str``
in the schema because several values, like ``token-mean``, are not Python identifiers);
``RANGES`` the allowed range of every numeric field (a test keeps it complete).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

# the architectures megarl.utils.tiny_model makes (a light module: no torch at import)
from megarl.utils.tiny_model import ARCHS as TINY_ARCHS

KL_TYPES = ("low_var_kl", "k1", "k2", "k3", "kl", "abs", "mse")
# verl's straight-through kinds: the base kind's value, k2's gradient (megarl/algo/kl.py).
KL_TYPES = KL_TYPES + tuple(k + "+" for k in KL_TYPES)

CHOICES: Dict[str, tuple] = {
    "data.truncation": ("error", "left", "right"),
    "data.synthetic_task": (None, "quickstart", "last_digit", "tool_lookup"),
    "actor_rollout_ref.model.make_tiny": (None, *TINY_ARCHS),
    "data.bad_rows": ("skip", "error"),
    "actor_rollout_ref.actor.strategy": ("megatron",),
    "actor_rollout_ref.actor.loss_agg_mode": (
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
        "token-sum"),
    "actor_rollout_ref.actor.kl_loss_type": KL_TYPES,
    "actor_rollout_ref.actor.tis_level": ("token", "sequence"),
    # verl 0.9.1's policy losses less bypass_mode (megarl.algo.policy_losses.POLICY_LOSS_MODES;
    # bypass mode is algorithm.rollout_correction.bypass_mode)
    "actor_rollout_ref.actor.policy_loss.loss_mode": (
        "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv",
        "dppo_kl", "dro"),
    # R2 (replaying the LOGP pass's own routing in training) is not built: R3 covers both
    "actor_rollout_ref.actor.router_replay.mode": ("disabled", "R3"),
    # null: by trainer.device (megarl.config.device), filled in while the config loads
    "actor_rollout_ref.actor.megatron.params_dtype": (None, "float32", "bfloat16", "float16"),
    "actor_rollout_ref.ref.megatron.params_dtype": (None, "float32", "bfloat16", "float16"),
    "actor_rollout_ref.rollout.name": ("embedded", "sglang"),
    "actor_rollout_ref.rollout.dtype": ("auto", "float32", "bfloat16", "float16"),
    "actor_rollout_ref.rollout.update_group_backend": ("auto", "nccl", "gloo"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("middle", "left",
                                                                         "right"),
    # megarl.algo.advantages.ADV_ESTIMATORS; verl's names megarl does not build are refused
    # with the reason (config/validate.py)
    "algorithm.adv_estimator": (
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "drgrpo", "gae",
        "grpo_passk", "opo", "gpg", "rloo_vectorized", "remax", "gdpo"),
    "algorithm.kl_penalty": KL_TYPES,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.stale_policy": ("drop", "regenerate"),
    # verl's algorithm.rollout_correction (megarl.algo.rollout_correction)
    "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "reinforce"),
    # what megarl keeps per response: the reward that trains (reward, seq_reward) and the
    # reward function's score before an overlong penalty (acc, score: verl's DAPO manager's
    # names of it); other reward_extra_info fields are refused by name (config/validate.py)
    "algorithm.filter_groups.metric": ("reward", "seq_reward", "acc", "score"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.launcher": ("ray", "torchrun"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
}

CHOICES["critic.strategy"] = ("megatron",)
CHOICES["critic.loss_agg_mode"] = (None, *CHOICES["actor_rollout_ref.actor.loss_agg_mode"])
CHOICES["critic.megatron.params_dtype"] = CHOICES["actor_rollout_ref.actor.megatron.params_dtype"]
# The sections of the config that build a Megatron model.
MEGATRON_SECTIONS = ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron",
                     "critic.megatron")
for _section in MEGATRON_SECTIONS:
    CHOICES[f"{_section}.transformer_impl"] = ("auto", "local", "transformer_engine")
    CHOICES[f"{_section}.override_transformer_config.moe_token_dispatcher_type"] = (
        None, "alltoall", "allgather")
    CHOICES[f"{_section}.override_transformer_config.moe_token_drop_policy"] = (
        "probs", "position")
    CHOICES[f"{_section}.override_transformer_config.recompute_granularity"] = (
        None, "full", "selective")
    CHOICES[f"{_section}.override_transformer_config.recompute_method"] = (
        None, "uniform", "block")
    CHOICES[f"{_section}.override_transformer_config.attention_backend"] = (
        "auto", "flex", "flash", "fused", "unfused")
    CHOICES[f"{_section}.optimizer"] = ("megatron", "torch")
for _section in ("actor_rollout_ref.actor.optim", "critic.optim"):
    CHOICES[f"{_section}.lr_decay_style"] = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: between ``low`` and ``high`` (None: unbounded), each
    bound inclusive unless ``*_open``, plus the sentinels in ``also`` that mean something
    (``-1``: off). For a list field it applies to every item, and ``length`` fixes the count."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    also: Tuple[int, ...] = ()
    length: Optional[int] = None

    def allows(self, value: float) -> bool:
        if value in self.also:
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{low}, "
                    f"{high}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {high}"
        else:
            text = "any finite number"
        return " or ".join([*map(str, self.also), text])


def _number(x: Optional[float]) -> str:
    if isinstance(x, int) and x >= 2**16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
PROBABILITY = Range(0, 1, low_open=True)
UNIT = Range(0, 1)
OFF_OR_POSITIVE = Range(1, also=(-1,))
# SGLang seeds numpy (which takes < 2**32) with trainer.seed + replica index, and sampling
# seeds are trainer.seed * 1_000_003 + step, which must stay inside int64.
SEED = Range(0, 2**31, high_open=True)

_A = "actor_rollout_ref"
# Keys absent here take any finite value of their type; a unit test fails when a numeric
# field has no entry, so a new field gets a range when it is added. Null (where the type is
# Optional) is always allowed and keeps its documented meaning.
RANGES: Dict[str, Range] = {
    "data.max_prompt_length": POSITIVE,
    "data.max_response_length": POSITIVE,
    "data.train_batch_size": POSITIVE,
    "data.val_batch_size": POSITIVE,
    "data.seed": SEED,
    f"{_A}.actor.ppo_mini_batch_size": POSITIVE,
    f"{_A}.actor.ppo_micro_batch_size_per_gpu": POSITIVE,
    f"{_A}.actor.ppo_max_token_len_per_gpu": POSITIVE,
    f"{_A}.ref.log_prob_max_token_len_per_gpu": POSITIVE,
    f"{_A}.rollout.log_prob_max_token_len_per_gpu": POSITIVE,
    "critic.ppo_max_token_len_per_gpu": POSITIVE,
    "critic.forward_max_token_len_per_gpu": POSITIVE,
    f"{_A}.actor.ppo_epochs": POSITIVE,
    f"{_A}.actor.clip_ratio": POSITIVE,
    f"{_A}.actor.clip_ratio_low": PROBABILITY,     # the ratio's lower bound 1 - low stays >= 0
    f"{_A}.actor.clip_ratio_high": POSITIVE,
    f"{_A}.actor.clip_ratio_c": Range(1, low_open=True),
    f"{_A}.actor.entropy_coeff": NON_NEGATIVE,
    f"{_A}.actor.kl_loss_coef": NON_NEGATIVE,
    f"{_A}.actor.tis_imp_ratio_cap": POSITIVE,
    f"{_A}.actor.loss_scale_factor": POSITIVE,
    f"{_A}.actor.tau_pos": POSITIVE,
    f"{_A}.actor.tau_neg": POSITIVE,
    f"{_A}.actor.policy_loss.clip_cov_ratio": PROBABILITY,
    f"{_A}.actor.policy_loss.clip_cov_lb": Range(),  # a covariance: any sign
    f"{_A}.actor.policy_loss.clip_cov_ub": Range(),
    f"{_A}.actor.policy_loss.kl_cov_ratio": PROBABILITY,
    f"{_A}.actor.policy_loss.ppo_kl_coef": NON_NEGATIVE,
    f"{_A}.actor.policy_loss.dro_beta": POSITIVE,
    f"{_A}.rollout.weight_sync_timeout_s": POSITIVE,
    f"{_A}.rollout.weight_sync_min_bandwidth_mbps": POSITIVE,
    f"{_A}.actor.optim.lr": NON_NEGATIVE,
    f"{_A}.actor.optim.weight_decay": NON_NEGATIVE,
    f"{_A}.actor.optim.betas": Range(0, 1, high_open=True, length=2),
    f"{_A}.actor.optim.eps": POSITIVE,
    f"{_A}.actor.optim.clip_grad": NON_NEGATIVE,    # 0 turns clipping off
    f"{_A}.actor.optim.lr_warmup_steps": NON_NEGATIVE,
    f"{_A}.actor.optim.min_lr": NON_NEGATIVE,
    f"{_A}.actor.optim.total_training_steps": POSITIVE,
    **{f"{_A}.{role}.megatron.{key}": POSITIVE
       for role in ("actor", "ref")
       for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "make_vocab_size_divisible_by")},
    f"{_A}.actor.megatron.seed": SEED,
    f"{_A}.logp.tensor_model_parallel_size": POSITIVE,
    f"{_A}.logp.pipeline_model_parallel_size": POSITIVE,
    f"{_A}.ref.megatron.seed": SEED,
    f"{_A}.ref.log_prob_micro_batch_size_per_gpu": POSITIVE,
    f"{_A}.rollout.server_start_timeout_s": POSITIVE,
    f"{_A}.rollout.engine_health_interval_s": POSITIVE,
    f"{_A}.rollout.engine_health_timeout_s": POSITIVE,
    f"{_A}.rollout.engine_max_restarts": NON_NEGATIVE,
    f"{_A}.rollout.tensor_model_parallel_size": POSITIVE,
    # SGLang's own rules: temperature 0 is greedy, top_p in (0, 1], top_k -1 (off) or >= 1.
    f"{_A}.rollout.temperature": NON_NEGATIVE,
    f"{_A}.rollout.top_p": PROBABILITY,
    f"{_A}.rollout.top_k": OFF_OR_POSITIVE,
    f"{_A}.rollout.n": POSITIVE,
    f"{_A}.rollout.max_new_tokens": POSITIVE,
    f"{_A}.rollout.min_new_tokens": NON_NEGATIVE,
    f"{_A}.rollout.gpu_memory_utilization": PROBABILITY,
    f"{_A}.rollout.log_prob_micro_batch_size_per_gpu": POSITIVE,
    f"{_A}.rollout.param_update_preduce_bucket_size_mb": POSITIVE,
    f"{_A}.rollout.param_update_consume_bucket_size_mb": POSITIVE,
    f"{_A}.rollout.over_sample_prompts": NON_NEGATIVE,
    f"{_A}.rollout.multi_turn.max_assistant_turns": POSITIVE,
    f"{_A}.rollout.multi_turn.max_parallel_calls": POSITIVE,
    f"{_A}.rollout.multi_turn.max_tool_response_length": POSITIVE,
    f"{_A}.rollout.multi_turn.tool_timeout_s": POSITIVE,
    f"{_A}.rollout.multi_turn.tool_workers": POSITIVE,
    f"{_A}.rollout.multi_turn.dump_trajectories": NON_NEGATIVE,
    f"{_A}.rollout.val_kwargs.temperature": NON_NEGATIVE,
    f"{_A}.rollout.val_kwargs.top_p": PROBABILITY,
    f"{_A}.rollout.val_kwargs.top_k": OFF_OR_POSITIVE,
    f"{_A}.rollout.val_kwargs.n": POSITIVE,
    "critic.ppo_mini_batch_size": POSITIVE,
    "critic.ppo_micro_batch_size_per_gpu": POSITIVE,
    "critic.forward_micro_batch_size_per_gpu": POSITIVE,
    "critic.ppo_epochs": POSITIVE,
    "critic.cliprange_value": POSITIVE,
    "critic.optim.lr": NON_NEGATIVE,
    "critic.optim.weight_decay": NON_NEGATIVE,
    "critic.optim.betas": Range(0, 1, high_open=True, length=2),
    "critic.optim.eps": POSITIVE,
    "critic.optim.clip_grad": NON_NEGATIVE,
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size": POSITIVE,
    "critic.optim.lr_warmup_steps": NON_NEGATIVE,
    "critic.optim.min_lr": NON_NEGATIVE,
    "critic.optim.total_training_steps": POSITIVE,
    **{f"critic.megatron.{key}": POSITIVE
       for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "make_vocab_size_divisible_by")},
    "critic.megatron.seed": SEED,
    "trainer.critic_warmup": NON_NEGATIVE,
    **{f"{section}.{key}": POSITIVE for section in MEGATRON_SECTIONS
       for key in ("expert_model_parallel_size", "expert_tensor_parallel_size",
                   "context_parallel_size",
                   "virtual_pipeline_model_parallel_size",
                   "override_transformer_config.moe_expert_capacity_factor",
                   "override_transformer_config.recompute_num_layers")},
    **{f"{section}.override_transformer_config.{key}": NON_NEGATIVE
       for section in MEGATRON_SECTIONS for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff")},
    "algorithm.gamma": UNIT,
    "algorithm.lam": UNIT,
    "algorithm.kl_ctrl.kl_coef": NON_NEGATIVE,
    "algorithm.kl_ctrl.target_kl": POSITIVE,
    "algorithm.kl_ctrl.horizon": POSITIVE,
    "algorithm.max_staleness": NON_NEGATIVE,
    "algorithm.filter_groups.max_num_gen_batches": Range(),  # <= 0: no limit (verl's meaning)
    "algorithm.gdpo_reward_weights": Range(),  # a weight of any sign (verl checks none)
    "reward.num_workers": POSITIVE,
    "reward.timeout_s": POSITIVE,
    "reward.sandbox.max_time_limit_s": POSITIVE,
    "reward.sandbox.max_memory_limit_mb": POSITIVE,
    "reward.failure_score": Range(),
    "reward.reward_kwargs.max_resp_len": POSITIVE,
    "reward.reward_kwargs.overlong_buffer_cfg.len": NON_NEGATIVE,
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": NON_NEGATIVE,
    "trainer.nnodes": POSITIVE,
    "trainer.n_gpus_per_node": POSITIVE,
    "trainer.separated_node_ratios": POSITIVE,   # the layout checks that they sum to 1
    "trainer.generate_ahead_steps": POSITIVE,
    "trainer.total_epochs": POSITIVE,
    "trainer.total_training_steps": POSITIVE,
    "trainer.test_freq": OFF_OR_POSITIVE,
    "trainer.save_freq": OFF_OR_POSITIVE,
    "trainer.timeline_freq": OFF_OR_POSITIVE,
    "trainer.max_actor_ckpt_to_keep": POSITIVE,
    "trainer.max_restarts": NON_NEGATIVE,
    "trainer.log_val_generations": NON_NEGATIVE,
    "trainer.restart_backoff_s": NON_NEGATIVE,
    "trainer.placement_timeout_s": POSITIVE,
    "trainer.state_timeout_s": POSITIVE,
    "trainer.state_min_tokens_per_s": POSITIVE,
    "trainer.seed": SEED,
}


@dataclass
class DataConfig:
    train_files: Any = "outputs/data/train.jsonl"
    """Training data: a path or a list of paths (jsonl or parquet)."""
    val_files: Any = None
    """Validation data: a path, a list of paths, or null for no validation set."""
    synthetic_task: Optional[str] = None
    """``quickstart``: write the synthetic arithmetic task to ``train_files``/``val_files``
    when they do not exist yet (so a fresh machine needs no download); ``last_digit``: the
    task that ``configs/quickstart_solve.yaml`` solves ("Repeat the last digit: 4 3 9")."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string or a list of chat messages)."""
    reward_fn_key: str = "data_source"
    """Column whose value selects each row's reward (verl's ``data.reward_fn_key``): it is
    what the reward function gets as ``data_source``, what the built-in scorers dispatch on,
    and what validation's per-source metrics are grouped by. Every row needs it as a
    non-empty string."""
    return_raw_chat: bool = True
    """Accepted for verl's scripts; changes nothing. verl 0.9.1 reads it and then always
    returns the raw chat (its agent loop templates prompts); megarl always keeps each row's
    raw prompt beside its token ids, and the rollout generates from the ids."""
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's ``apply_chat_template`` wherever a chat
    prompt is templated (training and validation sets, preflight's length checks), e.g.
    ``{enable_thinking: false}`` to turn Qwen3's thinking off. Keys megarl sets itself
    (``add_generation_prompt``, ``tokenize`` ...) are refused."""
    max_prompt_length: int = 256
    """Longest prompt in tokens; see ``filter_overlong_prompts`` and ``truncation``."""
    max_response_length: int = 128
    """Longest response in tokens; the default for ``rollout.max_new_tokens``."""
    train_batch_size: int = 4
    """Prompts per training step (each sampled ``rollout.n`` times)."""
    val_batch_size: Optional[int] = None
    """Validation prompts in flight at once: the set is generated in rounds of this many
    prompts, each round started when the one before has finished (bounds what validation
    holds on the engines beside training's work); null: the whole set at once, as verl."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than ``max_prompt_length`` when the dataset is loaded."""
    truncation: str = "error"
    """What to do with a prompt that is still too long: error, or cut its left/right end."""
    shuffle: bool = True
    """Shuffle the training set every epoch."""
    seed: int = 1
    """Seed of the data shuffle."""
    bad_rows: str = "skip"
    """A malformed row (missing prompt key, bad JSON): skip it with a warning, or error."""


@dataclass
class ModelConfig:
    path: str = "outputs/tiny-qwen2"
    """Hugging Face model directory (converted to Megatron on load)."""
    make_tiny: Optional[str] = None
    """``qwen2``, ``qwen3``, ``qwen3_moe``, ``glm4_moe`` (GLM-4.5's layout) or ``llama``: make a
    tiny random model with a local tokenizer at ``path`` when it does not exist yet
    (quickstart, tests, laptops)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; null means ``path``."""
    trust_remote_code: bool = False
    """Let transformers run the model's own code: passed wherever megarl loads the model's
    config, weights or tokenizer, and to launched SGLang servers (``--trust-remote-code``)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory: the actor's layers keep only their
    inputs after forward and run again in backward (Megatron's full recompute, one layer at a
    time); the same step, bit for bit, for about one more forward pass of compute."""
    override_config: Dict[str, Any] = field(default_factory=dict)
    """Keys that override the model's HF config when planning (``--dry-run``: e.g. a longer
    context, more layers); a run refuses them, since it builds every model from the model
    directory's config.json as it is."""
    hf_config_path: Optional[str] = None
    """A ``config.json`` to plan with (``--dry-run``) where ``path`` is not on this machine;
    null means ``path``/config.json. Planning only: a run refuses it."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (TP/PP aware)."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 to ``lr`` over this many steps; 0 for none."""
    lr_decay_style: str = "constant"
    """After the warm-up: ``constant`` (stay at ``lr``), or ``linear`` / ``cosine`` decay to
    ``min_lr`` at the end of the schedule (Megatron's ``OptimizerParamScheduler``)."""
    min_lr: float = 0.0
    """Where a linear or cosine decay ends; at most ``lr``."""
    total_training_steps: Optional[int] = None
    """Steps of the LR schedule; null means the trainer's total steps, known at runtime."""
    fused: Optional[bool] = None
    """Where neither Transformer Engine nor Apex is installed (Megatron then steps with
    ``torch.optim.AdamW``): ``true`` steps with torch's fused AdamW kernel (``fused=True``)
    and takes the gradient norm with one ``torch._foreach_norm`` instead of one norm and host
    sync per tensor; the same weights to ~1e-7 in fp32. null: off (it has not been measured
    on a GPU yet). With TE or Apex their fused Adam runs either way."""


@dataclass
class TransformerOverrides:
    """Settings of Megatron's TransformerConfig under verl's path for them
    (``megatron.override_transformer_config``) and Megatron's names: a mixture of experts'
    router (a dense model ignores those) and activation recompute. Only these keys: any other
    is refused by name, not passed through unchecked."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing (auxiliary) loss coefficient; 0: none. It adds to the RL loss a term
    the RL objective does not have, so RL runs (verl's too) leave it off."""
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient (keeps router logits small); null: none."""
    moe_token_dispatcher_type: Optional[str] = None
    """How tokens reach their experts' ranks: ``alltoall`` or ``allgather``; null: alltoall
    on GPUs, allgather on the CPU (alltoall needs CUDA streams). Without token dropping both
    send every token to the same experts."""
    moe_expert_capacity_factor: Optional[float] = None
    """Tokens an expert takes, as a multiple of an even share; beyond it tokens are dropped
    (``moe_token_drop_policy``). null: no capacity, no token dropped, what RL wants (a
    dropped token's log-prob is not the engine's)."""
    moe_token_drop_policy: str = "probs"
    """Which tokens a full expert drops: ``probs`` (lowest routing probability) or
    ``position`` (latest)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute in a model that trains: ``full`` (whole layers: only their inputs
    are kept) or ``selective`` (the core attention of every layer); null: what
    ``model.enable_gradient_checkpointing`` says (full, uniform, one layer at a time, for the
    actor). Steps are the same with or without; only memory and time change."""
    recompute_method: Optional[str] = None
    """With ``full``: ``uniform`` (the layers in groups of ``recompute_num_layers``, each group
    recomputed from its input) or ``block`` (the first ``recompute_num_layers`` layers of each
    pipeline stage recomputed, the rest kept); null: uniform. Not with ``selective``."""
    recompute_num_layers: Optional[int] = None
    """With ``full``: layers per recomputed group (uniform) or recomputed layers per stage
    (block); null: 1. Not with ``selective``."""
    attention_backend: str = "auto"
    """The attention kernel (Megatron's key; its names where they apply). With megarl's
    SDPA attention (no Transformer Engine): ``auto`` lets torch's SDPA choose (flash / cuDNN
    on CUDA) and runs packed sequences through FlexAttention on CUDA (a document mask made
    once per micro-batch; not yet measured on a GPU) and one SDPA call per sequence length
    on the CPU; ``flex``: FlexAttention for packed sequences on any device (eager and slow
    on the CPU); ``flash`` (verl's default), ``fused`` (cuDNN) put that SDPA kernel first,
    falling back to the others where it cannot run (the CPU, fp32); ``unfused``: SDPA's
    math kernel only; packed sequences one call per length under these three. With
    Transformer Engine's layers TE's own attention runs (it chooses its kernel), except
    under ``flex``. All give the same numbers."""
    bias_activation_fusion: Optional[bool] = None
    """Megatron's fused SwiGLU (``torch.compile``d, no Apex or TE needed): the same numbers
    as the plain activation, fewer kernels and saved tensors. null: off (not yet measured on
    a GPU; on the CPU the first call compiles for seconds)."""
    bias_dropout_fusion: Optional[bool] = None
    """Megatron's fused bias-dropout-add on the residual (``torch.compile``d); as above."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel width (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel depth (PP). A group's device count must be a multiple of TP×PP."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage (VPP, verl's key): Megatron's interleaved schedule,
    each stage holding VPP non-adjacent runs of layers, which shrinks the pipeline bubble.
    Needs PP >= 2 and num_hidden_layers divisible by PP×VPP; a call's micro-batch count is
    padded with empty micro-batches to a multiple of PP. null or 1: none."""
    expert_model_parallel_size: int = 1
    """Expert-parallel width (EP) of a mixture of experts: each EP rank holds num_experts / EP
    of every layer's experts, and tokens travel to their experts' ranks. EP ranks are taken
    from the data-parallel (and tensor-parallel) ranks of a stage, so EP × ETP must divide
    the group's devices / PP, and EP the model's num_experts."""
    expert_tensor_parallel_size: Optional[int] = None
    """Ranks each expert is split over (ETP); null: the TP width."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (verl's key) at TP > 1: norms and the residual stream
    sharded over the sequence across the TP ranks (an all-gather before and a reduce-scatter
    after each TP linear, in place of the all-reduce), so activations outside attention and
    the MLP take 1/TP of the memory; sequences are padded to a multiple of TP, and the
    numbers are those without it. Ignored at TP=1. verl defaults it to true; megarl to
    false, so a config that leaves it out runs as before this key existed."""
    context_parallel_size: int = 1
    """Context parallelism (CP, verl's key): every sequence split over CP ranks in 2·CP
    chunks (rank r holds chunks r and 2·CP-1-r, the causal-balance layout), attention over
    the CP group; activations per rank shrink by CP. A group's device count must be a
    multiple of TP×PP×CP. A logp replica runs the actor's."""
    override_transformer_config: TransformerOverrides = field(
        default_factory=TransformerOverrides)
    """Router settings of a mixture of experts (Megatron's names, verl's path)."""
    params_dtype: Optional[str] = None
    """Parameter dtype; null (the default) follows ``trainer.device``: ``bfloat16`` on cuda
    (verl's default), ``float32`` on cpu. A value given here is kept on either device."""
    seed: int = 42
    """Megatron's model-parallel RNG seed."""
    optimizer: str = "megatron"
    """``megatron``: Megatron's DDP and optimizer (bf16 params keep fp32 main params; the
    distributed optimizer below), the same on CPU and GPU. ``torch``: plain AdamW with
    TP/PP-aware clipping, a fallback for CPU runs."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and main params over data-parallel ranks (needs
    ``optimizer: megatron``)."""
    overlap_grad_reduce: bool = False
    """Reduce gradients bucket by bucket while the backward pass still runs (Megatron DDP;
    needs ``optimizer: megatron``)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this × TP."""
    transformer_impl: str = "auto"
    """Layer implementation: ``transformer_engine`` (Transformer Engine's fused norm + linear
    layers; needs TE installed and trainer.device=cuda), ``local`` (Megatron's own layers), or
    ``auto``: TE where it is installed and CUDA is present, else local. Attention is torch's
    SDPA either way (its flash / memory-efficient kernels on CUDA). Checkpoints and HF weights
    are the same for both."""


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"
    """Routing replay for a mixture of experts (verl's key): ``R3`` makes the actor's routers,
    in the LOGP pass and in training, take each token's top-k experts from the ones the
    rollout engine routed it to (needs ``rollout.enable_rollout_routing_replay``), so the
    trainer's log-probs are those of the engine's computation and the train-rollout
    mismatch (``rollout/logp_mismatch_mean``, ``actor/logp_mismatch``) falls; the gradient
    still reaches the router through the chosen experts' weights. The reference model keeps
    its own routing. ``disabled``: every router routes by itself."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """The policy loss, by verl's name (docs/algorithms.md, "Policy loss modes"): vanilla
    (PPO clip, dual clip), gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv,
    dppo_kl, dro. Each composes with the off-policy correction (``tis_imp_ratio_cap``) as
    vanilla does."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the share of a micro-batch's tokens (at least one) whose gradient is cut,
    drawn among those with a covariance inside (clip_cov_lb, clip_cov_ub)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance (A - mean A)(logp - mean logp) of a candidate."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of a candidate's covariance; more than ``clip_cov_lb``."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the share of a micro-batch's tokens (at least one), those of largest
    covariance, that get the |log ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of the |log ratio| penalty on the chosen tokens."""
    dro_beta: Optional[float] = None
    """dro: weight of the quadratic log-ratio penalty, beta/2 (log r)^2; required (> 0) by
    loss_mode dro, unused by the others."""


@dataclass
class ActorConfig:
    strategy: str = "megatron"
    """Training backend; only Megatron-core."""
    ppo_mini_batch_size: int = 4
    """Prompts per optimizer step (a training batch is split into mini-batches)."""
    ppo_micro_batch_size_per_gpu: int = 2
    """Sequences per forward/backward on one device (gradient accumulation unit)."""
    use_dynamic_bsz: bool = False
    """Micro-batches by tokens, not rows (verl's key): each mini-batch is split into
    micro-batches of at most ``ppo_max_token_len_per_gpu`` real tokens, balanced by tokens
    across micro-batches and data-parallel ranks (as many micro-batches on every rank), and
    each micro-batch is packed into one row (no compute on padding). Losses and gradients
    equal the padded path's; ``ppo_micro_batch_size_per_gpu`` is then unused. Also the
    default of the log-prob passes' and the critic's ``*use_dynamic_bsz``."""
    ppo_max_token_len_per_gpu: int = 16384
    """With ``use_dynamic_bsz``: real tokens per training micro-batch on one device (a longer
    sequence goes alone). Also the default of the log-prob passes' and the critic's token
    budgets."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    clip_ratio: float = 0.2
    """PPO clip range; the default for the low/high bounds below."""
    clip_ratio_low: Optional[float] = None
    """Lower clip (1 - low); null means ``clip_ratio``."""
    clip_ratio_high: Optional[float] = None
    """Upper clip (1 + high); null means ``clip_ratio`` (DAPO's clip-higher sets it larger)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; must be > 1. The dppo loss modes truncate
    their ratio at it instead."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss, and the hyper-parameters of the modes that read them (verl's)."""
    tau_pos: float = 1.0
    """loss_mode sapo: gate temperature where the advantage is > 0."""
    tau_neg: float = 1.05
    """loss_mode sapo: gate temperature where the advantage is <= 0."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number over the mini-batch (verl's names): token-mean,
    seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (the mean over sequences
    of their token sums, / a constant, see ``loss_scale_factor``), token-sum
    (docs/algorithms.md)."""
    loss_scale_factor: Optional[float] = None
    """The constant C of ``seq-mean-token-sum-norm`` (loss = sum of masked token losses /
    (number of sequences * C), verl 0.9.1's definition); null means
    ``data.max_response_length`` (the padded response width verl's default uses)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    entropy_from_logits_with_chunking: bool = False
    """Log-probs and entropy ``entropy_from_logits_chunk_size`` tokens at a time (verl's
    key), for the actor, its log-prob replica and the reference: no fp32 [tokens, vocab]
    tensor is built beyond one chunk's, and backward recomputes each chunk's softmax (one
    more pass over the logits). The same values and gradients as without."""
    entropy_from_logits_chunk_size: int = 2048
    """Tokens per chunk of ``entropy_from_logits_with_chunking``."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """A mixture of experts: whose routing the actor's forward passes use."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the KL loss; a ``+`` suffix (``k3+``, ``low_var_kl+``) keeps the value
    and takes k2's gradient (straight-through)."""
    tis_imp_ratio_cap: Optional[float] = 2.0
    """Truncated importance sampling: cap on the behaviour weight pi_proximal/pi_behaviour
    (the rollout engine's own log-probs are the behaviour policy); null leaves the weight
    untruncated (plain decoupled PPO). The same weight as verl's
    ``algorithm.rollout_correction.rollout_is_threshold`` (a single number), which sets it
    when ``rollout_is`` is set."""
    tis_level: str = "token"
    """``token``: one importance weight per token; ``sequence``: one per response, the product
    over its tokens (unbiased for sequence-level rewards, higher variance)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of the trained model (the ``logp`` and ``actor-train`` tasks)."""


@dataclass
class ValKwargsConfig:
    temperature: float = 0.0
    """Sampling temperature at validation; 0 with do_sample=False is greedy."""
    top_p: float = 1.0
    """Nucleus sampling at validation."""
    top_k: int = -1
    """Top-k at validation; -1 disables."""
    n: int = 1
    """Samples per validation prompt."""
    do_sample: bool = False
    """Sample at validation (else greedy)."""


@dataclass
class MultiTurnConfig:
    """Multi-turn tool use (``megarl.agent``): verl's ``multi_turn`` names where they fit."""
    enable: bool = False
    """Every sample is an agent trajectory: generate a turn, run the tools it calls, append
    their answers as token ids (loss mask 0), go on; one reward at the end. Works with every
    rollout policy (plain, partial, ``rollout_fn``), validation included."""
    tools: List[Any] = field(default_factory=list)
    """The tools: a built-in's name (``calculator``, ``python``: run in the reward sandbox,
    ``lookup``) or ``{name, function: module:function, description, parameters}`` (OpenAI
    format, ``parameters`` a JSON schema the arguments are checked against). A sample's
    ``extra_info.tools_kwargs.<name>`` is passed to that tool as keyword arguments."""
    format: str = "hermes"
    """How tool calls are written: ``hermes`` (``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>``, Qwen2.5/Qwen3) or a parser ``module:function`` (text ->
    (calls, errors), see ``megarl.agent.parsers``)."""
    max_assistant_turns: int = 5
    """Assistant turns per sample at most; the last one's tool calls are not run."""
    max_parallel_calls: int = 1
    """Tool calls run per turn; further calls in the turn are answered with an error."""
    max_tool_response_length: int = 256
    """Tokens of one tool answer at most; a longer one is cut (``tool_response_truncate_side``)."""
    tool_response_truncate_side: str = "middle"
    """Which part of a long answer is kept: ``middle`` cuts its middle out, ``left`` keeps
    its end, ``right`` its start."""
    tool_response_template: str = ("\n<|im_start|>user\n<tool_response>\n{content}\n"
                                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    """The tokens appended after a turn that called tools, as text around ``{content}`` (the
    answers): the chat template's tool turn and the next assistant header (Qwen's)."""
    tool_response_separator: str = "\n</tool_response>\n<tool_response>\n"
    """Between two answers of one turn inside ``{content}``."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; then its worker is killed and the model is told."""
    tool_workers: int = 2
    """Processes running tool calls (a hung tool ties up one until ``tool_timeout_s``)."""
    dump_trajectories: int = 1
    """Per step, this many samples' trajectories (turns, token ids, mask, calls, answers) are
    written as JSON to ``<run dir>/trajectories/step_<k>.json``; 0: none."""


@dataclass
class RolloutConfig:
    name: str = "embedded"
    """Engine: ``embedded`` (megarl's transformers engine, CPU/CI/laptops; it stages weight
    updates and swaps them in, so generation goes on during a transfer) or ``sglang`` (stock
    SGLang servers: generation pauses while each weight version is received and loaded)."""
    server_urls: Optional[List[str]] = None
    """Use these already-running SGLang-API servers (``http://host:port``, one per rollout
    replica) instead of launching any; their TP is ``tensor_model_parallel_size``."""
    api_key: Optional[str] = None
    """The token every rollout server of the run requires (stock SGLang's ``--api-key``; the
    embedded server's too) on every endpoint but ``/health``, and that megarl sends: give the
    ``--api-key`` of the ``server_urls`` servers here. null: a fresh random token per run (under
    torchrun, derived from ``MEGARL_CONTROL_SECRET``), for the servers the run launches
    (docs/security.md)."""
    server_module: Optional[str] = None
    """Module run as ``python -m MODULE`` for each launched server; null means
    ``sglang.launch_server`` for ``sglang`` (``megarl.rollout.server`` serves the same
    contract, which is how CI runs this path)."""
    server_python: Optional[str] = None
    """The Python that runs launched stock SGLang servers; null: ``$MEGARL_SGLANG_PYTHON``,
    else the CPU environment ``tools/setup_sglang_env.sh`` builds (when built and current),
    else megarl's own Python (GPU installs, ``pip install -e .[gpu]``)."""
    server_extra_args: List[str] = field(default_factory=list)
    """Extra command-line arguments for every launched server (e.g.
    ``[--enable-deterministic-inference]``, which SGLang needs to honour sampling seeds)."""
    dtype: str = "auto"
    """The dtype launched servers hold the weights in (``--dtype``); ``auto``: the actor's
    ``megatron.params_dtype``, the dtype the trainer sends, so rollouts sample from the
    weights as trained (SGLang's own ``auto`` serves a float32 checkpoint in float16)."""
    server_start_timeout_s: float = 900.0
    """How long a launched server, or a replacement engine of either backend, may take to
    answer before the run stops (a replacement: before its slot is given up)."""
    engine_health_interval_s: float = 2.0
    """While requests are in flight, each engine is asked for its ``/model_info`` this often
    (the health check); an engine whose process died, whose connection broke or whose health
    check fails is replaced."""
    engine_health_timeout_s: float = 10.0
    """A health check (``/model_info``) answered slower than this marks the engine dead
    (wedged)."""
    engine_max_restarts: int = 3
    """Replacements per engine slot (0: none); past them the run goes on with fewer engines
    and stops with an error naming each engine once none is left. A replacement gets the
    newest weights out of band at once, so a run whose every engine died goes on; with 0 a
    weight sync that finds no engine left fails the run."""
    tensor_model_parallel_size: int = 1
    """TP of one engine; the generate group's device count must be a multiple of it."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    top_k: int = -1
    """Top-k for training rollouts; -1 disables."""
    n: int = 4
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: Optional[int] = None
    """Generation budget; null means ``data.max_response_length`` (filled in by the loader)."""
    min_new_tokens: int = 0
    """Tokens generated before a stop token may end the output (SGLang's ``min_new_tokens``),
    in training and validation alike; with ``multi_turn`` per assistant turn, so 1 forbids an
    empty turn. A token drawn under the ban reports its log-prob among the allowed tokens, as
    stock SGLang does (the trainer recomputes it unbanned: the truncated importance weight
    corrects for the difference)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory SGLang may take (weights + KV cache)."""
    log_prob_micro_batch_size_per_gpu: int = 4
    """Sequences per log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """The LOGP pass (the proximal policy's log-probs) by token budget, packed; null means
    ``actor.use_dynamic_bsz``."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Real tokens per LOGP micro-batch; null means ``actor.ppo_max_token_len_per_gpu``."""
    enable_dual_buffer: bool = False
    """The trainer blocks only for a snapshot of its weights; a background sender delivers it
    while training goes on. (Stock SGLang still pauses generation while a version loads; the
    embedded engine stages it and keeps generating.)"""
    update_group_backend: str = "auto"
    """The weight-update group's backend: ``nccl`` (GPU to GPU), ``gloo`` (buckets staged
    through host memory), or ``auto``: NCCL on CUDA unless two members of the group would sit
    on one GPU, which NCCL cannot hold (``generate`` on ``actor-train``'s devices, as in a
    one-GPU quickstart, or a logp replica on ``generate``'s), then gloo; gloo on the CPU.
    The loader writes the resolved value here."""
    weight_sync_timeout_s: float = 120.0
    """Floor of every weight-sync wait (an update call, a broadcast, an engine's answer)."""
    weight_sync_min_bandwidth_mbps: float = 50.0
    """MB/s below which a bucket's transfer counts as failed: a bucket of n bytes waits at
    most ``weight_sync_timeout_s + n / this``, on gloo and NCCL alike (stock SGLang's side of
    the group would otherwise wait torch's 30-minute default); then the engines that did not
    answer are failed and replaced."""
    verify_weight_sync: bool = False
    """After every version, compare each engine's (and each logp replica's) checksum of every
    tensor with the trainer's (`/weights_checker`); a difference fails the sync naming the
    engine and tensor. Costs one hash of the model per version on both sides."""
    param_update_preduce_bucket_size_mb: int = 512
    """MiB of exported weights the sending trainer rank gathers (TP all-gather, its PP stage)
    before sending them (spelling from the feature request)."""
    param_update_consume_bucket_size_mb: int = 128
    """MiB: the largest flattened bucket on the wire, i.e. the receive buffer an engine
    allocates (a single larger tensor travels alone); at most the produce size."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling used by validation."""
    partial_rollout: bool = False
    """Partial rollout: once a step has ``data.train_batch_size`` complete prompt groups, abort
    the rest, cache each unfinished trajectory (tokens, behaviour log-probs, per-token
    versions) and resume it in a later step under newer weights. The cache is checkpointed."""
    over_sample_prompts: Optional[int] = None
    """With partial rollout: prompt groups kept in flight beyond ``data.train_batch_size`` so
    the engines never idle while the long tail runs; null means half the batch (at least 1)."""
    rollout_fn: Optional[str] = None
    """Import path ``module:function`` (or ``file.py:function``) of a rollout function
    ``async fn(ctx, sampling) -> StepRollout`` that makes a step's samples (multi-turn, tools,
    a custom prompt mix); ``ctx`` is a ``megarl.controller.trajectory.RolloutContext`` whose
    ``runner`` generates, resumes after aborts and scores. null: the built-in (plain, or
    partial with ``partial_rollout``)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn tool use: an agent loop over whichever rollout policy runs."""
    enable_rollout_routing_replay: bool = False
    """A mixture of experts: every engine reports, with each sample, the experts it routed
    each token to (stock SGLang: launched with ``--enable-return-routed-experts``, asked
    with ``return_routed_experts``; the embedded engine the same), kept with the sample
    through partial rollout and checkpoints, for ``actor.router_replay.mode: R3``."""


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 4
    """Sequences per reference log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Reference log-probs by token budget, packed; null means ``actor.use_dynamic_bsz``."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Real tokens per reference micro-batch; null means ``actor.ppo_max_token_len_per_gpu``."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of the frozen reference model (the ``ref_logp`` task)."""


@dataclass
class LogpConfig:
    tensor_model_parallel_size: Optional[int] = None
    """TP of the actor's replica that computes LOGP when ``logp`` has a task group of its own
    (fed by the weight sync, which reshards into it); null means the actor's TP. Only for that
    layout: beside actor-train, LOGP runs on the trainer itself."""
    pipeline_model_parallel_size: Optional[int] = None
    """PP of that replica; null means the actor's PP."""


@dataclass
class ActorRolloutRefConfig:
    async_pipeline: bool = False
    """Alias of ``trainer.generate_ahead_steps`` (the seed's key): true sets it to 2 (one step
    off) unless it asks for more, false to 1 (on-policy). Given both, the one given closer to
    the run wins (an override beats the file); contradicting each other at one level, both
    are refused."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (also the reference's initial weights)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engines and weight sync to them."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy for KL."""
    logp: LogpConfig = field(default_factory=LogpConfig)
    """The proximal policy's replica, when ``logp`` runs on a group of its own."""


@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    """HF model directory the critic's transformer starts from; null means the actor's
    ``actor_rollout_ref.model.path``. Its value head (hidden -> 1) starts at zero."""


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    """The value model of ``algorithm.adv_estimator=gae`` (unused by every other estimator):
    the actor's architecture with a scalar head, trained with the clipped value loss."""
    strategy: str = "megatron"
    """Training backend; only Megatron-core."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Where the critic's weights start."""
    optim: OptimConfig = field(default_factory=_critic_optim)
    """The critic's optimizer (verl's default critic lr is 1e-5)."""
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per critic optimizer step; null means the actor's ``ppo_mini_batch_size``."""
    ppo_micro_batch_size_per_gpu: int = 2
    """Sequences per critic forward/backward on one device."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Sequences per value forward (the VALUES state); null means
    ``ppo_micro_batch_size_per_gpu``."""
    use_dynamic_bsz: Optional[bool] = None
    """The critic's passes by token budget, packed; null means the actor's
    ``use_dynamic_bsz``."""
    ppo_max_token_len_per_gpu: Optional[int] = None
    """Real tokens per critic training micro-batch; null means the actor's
    ``ppo_max_token_len_per_gpu``."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Real tokens per value forward micro-batch; null means the critic's
    ``ppo_max_token_len_per_gpu``."""
    ppo_epochs: Optional[int] = None
    """Passes over each batch; null means the actor's ``ppo_epochs``."""
    cliprange_value: float = 0.5
    """Value clip: a new prediction counts as at most this far from the VALUES state's."""
    loss_agg_mode: Optional[str] = None
    """How per-token value losses become one number; null means the actor's mode."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of the critic (the ``critic`` task: its values and its training)."""


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    """KL coefficient controller for in-reward KL: fixed or adaptive."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient."""
    target_kl: float = 0.1
    """Adaptive controller's target KL."""
    horizon: int = 10000
    """Adaptive controller's horizon."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling: drop each prompt group whose ``metric`` is the same for all of
    its samples (no advantage to learn from) and generate groups of new prompts until the step
    has ``data.train_batch_size`` groups that differ (docs/algorithms.md)."""
    metric: str = "reward"
    """What must differ within a group: ``reward`` or ``seq_reward`` (what trains: the score
    plus any overlong penalty), ``acc`` or ``score`` (the reward function's score alone)."""
    max_num_gen_batches: int = 0
    """Most batches of ``data.train_batch_size`` prompts one step may draw before the run
    stops with an error naming this key; 0 or less: no limit. With partial rollout the
    over-sampled draws count too."""


@dataclass
class RolloutCorrectionConfig:
    """verl 0.9.1's rollout correction (its keys; defaults: its trainer YAML's, all off):
    importance weights, rejection sampling and bypass mode for the gap between the rollout
    engine's log-probs and the trainer's (docs/algorithms.md, "Rollout correction")."""
    rollout_is: Optional[str] = None
    """Importance weight pi_old/pi_rollout computed over the step's batch: ``token`` (one per
    token) or ``sequence`` (the product over the response, on each of its tokens); null: no
    weight from this section, megarl's own ``actor.tis_imp_ratio_cap``/``tis_level`` weight
    applies (``rollout_is: L`` with a single threshold C is the same weight as
    ``tis_level: L``, ``tis_imp_ratio_cap: C``, and sets them)."""
    rollout_is_threshold: Any = 2.0
    """A number (or number-like string): truncate the weights at it (TIS); a ``"lower_upper"``
    string (``"0.5_5.0"``): zero the weights outside [lower, upper] (IcePop). Quote a pair in
    YAML: unquoted, ``1_2`` reads as the integer 12 and ``0.5_2`` as 0.52."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their mean over the step's batch (per valid token; per sequence
    at the sequence level), after truncation. Not with ``bypass_mode``."""
    rollout_rs: Optional[str] = None
    """Rejection sampling: comma-separated options ``token_k1|k2|k3``,
    ``seq_sum_k1|k2|k3``, ``seq_mean_k1|k2|k3``, ``seq_max_k2|k3``; a token (token_*) or a
    whole response (seq_*) whose divergence (k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 -
    log r, r = pi_old/pi_rollout) is past ``rollout_rs_threshold`` leaves the actor's loss."""
    rollout_rs_threshold: Any = None
    """The bounds of ``rollout_rs``, one for all options or one per option (comma-separated):
    k1 takes ``"lower_upper"`` ratio bounds (a single u means [1/u, u]), k2 and k3 one upper
    bound. Required with ``rollout_rs``."""
    bypass_mode: bool = False
    """Use the rollout log-probs as the old policy: the LOGP pass is skipped and the loss is
    ``loss_type``'s, against pi_rollout (needs ``actor.policy_loss.loss_mode: vanilla``, and
    logp beside actor-train)."""
    loss_type: str = "ppo_clip"
    """Bypass mode's loss: ``ppo_clip`` (PPO clip of pi_theta/pi_rollout, no weight) or
    ``reinforce`` (-A log pi_theta times the ``rollout_is`` weight of pi_theta/pi_rollout)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator (docs/algorithms.md, "Advantages")."""
    gamma: float = 1.0
    """Discount factor per token (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda: 1 is Monte Carlo returns minus the value, 0 the one-step TD error."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (False is Dr. GRPO's choice); also divides
    ``grpo_passk``'s by its group's std, as in verl."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the reward (PPO style)."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty (no gradient there, so ``k3+`` is ``k3``)."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """Controller of the in-reward KL coefficient."""
    max_staleness: Optional[int] = None
    """Most weight versions a sample's oldest response token may lag the weights it is
    trained from; null means no limit. Must be >= ``trainer.generate_ahead_steps - 1`` (the
    lag the pipeline itself introduces)."""
    stale_policy: str = "drop"
    """What happens to a sample group over ``max_staleness``: ``drop`` it (counted, its prompt
    is not trained) or ``regenerate`` it from the prompt under the current weights."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling (DAPO): groups without spread are dropped and replaced."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction: importance weights, rejection sampling, bypass mode."""
    gdpo_reward_keys: List[str] = field(default_factory=list)
    """With ``adv_estimator: gdpo``: the entries of the dict the reward function returns that
    are normalised one by one within their group (e.g. ``[format_reward, accuracy_reward]``)."""
    gdpo_reward_weights: Optional[List[float]] = None
    """With ``gdpo``: a weight per ``gdpo_reward_keys`` entry for the sum; null: 1 each."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong penalty (megarl/reward/overlong.py): the last ``len`` tokens of the
    response budget cost up to ``penalty_factor``, linearly, added to the score."""
    len: int = 0
    """Tokens at the end of the budget over which the penalty grows (> 0 when enabled)."""
    penalty_factor: float = 1.0
    """The penalty at the budget's end."""
    log: bool = False
    """Log ``reward/overlong_penalty_mean`` and ``reward/overlong_frac`` each step, and at
    validation verl's ``val-aux/<data_source>/overlong_reward/...`` and ``.../overlong/...``."""


@dataclass
class RewardKwargsConfig:
    max_resp_len: Optional[int] = None
    """The budget the overlong penalty counts from; null: ``data.max_response_length``."""
    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (verl's keys)."""


@dataclass
class SandboxConfig:
    """The code sandbox (megarl/reward/sandbox.py) that code rewards and the ``python`` tool
    run model-written programs in; docs/security.md says what each layer holds."""
    max_time_limit_s: float = 30.0
    """The most wall time one program may have, whatever its task asks for
    (``extra_info.time_limit_s``, a tool call's arguments): larger asks get this."""
    max_memory_limit_mb: int = 4096
    """The most address space one process of a program may have, likewise."""
    allow_unhardened: bool = False
    """Run model code even where the host cannot give every layer (a minimal root, an
    unprivileged uid, seccomp): the run then starts with a warning naming what is missing.
    Off: such a host fails the run at start-up, before any model code runs."""


@dataclass
class RewardConfig:
    reward_fn: Optional[str] = None
    """Import path ``module:function`` of the reward function; null picks one by data source."""
    num_workers: int = 2
    """Processes in the streaming reward pool."""
    timeout_s: float = 30.0
    """Seconds one reward call may take before it scores ``failure_score`` (its worker is
    killed and replaced)."""
    failure_score: float = 0.0
    """Score given to a reward call that raises, times out, returns a non-number or whose
    worker dies; such calls are logged and counted in ``reward/failures``."""
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    """verl's DAPO reward settings: the overlong penalty."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Caps and policy of the code sandbox (code rewards, the ``python`` tool)."""


@dataclass
class TrainerConfig:
    device: str = "auto"
    """Where workers run: ``cpu`` (gloo) or ``cuda`` (nccl); ``auto`` (the default) is cuda
    when torch sees a GPU in the process that loads the config, cpu otherwise, decided once
    while the config loads and said in one log line. Set it where the driver's host is not a
    training node (a multi-node Ray cluster whose head has no GPU)."""
    nnodes: int = 1
    """Nodes in the cluster."""
    n_gpus_per_node: int = 1
    """Devices per node; on CPU, devices that share the node's cores (each model placed on a
    device, and its rollout engines, run in a process of their own)."""
    launcher: str = "ray"
    """How worker processes start: ``ray`` (placement groups, the default) or ``torchrun``
    (one process per device started by ``launch/torchrun.sh``; no Ray; see docs/launch.md)."""
    separated_node_tasks: List[Any] = field(
        default_factory=lambda: [["generate", "ref_logp", "logp", "actor-train"]])
    """Task groups: each item a task name or a list of task names sharing workers.
    Default: one colocated group. Alias: ``sperated_node_tasks``."""
    separated_node_ratios: List[float] = field(default_factory=lambda: [1.0])
    """Fraction of the nodes (of the devices on one node) per group; sums to 1.
    Alias: ``sperated_node_ratios``."""
    generate_ahead_steps: int = 1
    """How far generation may run ahead of training: 1 is on-policy, 2 one-step-off (also set
    by its alias ``actor_rollout_ref.async_pipeline``)."""
    sync_between_generations: bool = False
    """With generation ahead (>= 2): SYNC(k) waits until GENERATE(k + ahead - 1) has finished
    instead of until it has started, so every step's generation runs on one weight version
    (verl's one-step-off) and a seeded run's schedule, hence its samples, do not depend on
    timing. Costs the overlap of a transfer with generation."""
    total_epochs: int = 1
    """Passes over the training set."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps; null means total_epochs × steps per epoch (0 is refused,
    not read as null)."""
    test_freq: int = -1
    """Validate every this many steps; -1 never (besides val_before_train); 0 is refused."""
    save_freq: int = -1
    """Checkpoint every this many steps and after the last one; -1 never (as in verl: the run
    says so in its log when it starts); 0 is refused."""
    timeline_freq: int = 10
    """Every this many steps (and at the end) write the run's timeline: `timeline.json` (a
    Chrome trace of every task interval on every group so far) and `timeline.png` (a picture
    of the last `timeline_freq` steps, also logged to TensorBoard as the image `timeline`);
    -1 never; 0 is refused."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep only this many newest checkpoints (null keeps all); the newest one that verifies
    against its manifest is never deleted (docs/checkpoints.md)."""
    critic_warmup: int = 0
    """Train only the critic for this many first steps (the actor's weights stay put)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_only: bool = False
    """Only validate, then exit (needs data.val_files)."""
    logger: List[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: console, tensorboard, wandb, mlflow (docs/observability.md)."""
    log_val_generations: int = 0
    """Each validation logs its first this many responses (prompt, response, score) to every
    sink and to val_generations.jsonl in the run's directory; 0 none."""
    project_name: str = "megarl"
    """Groups experiments in the logger and output paths."""
    experiment_name: str = "default"
    """Names this run in the logger and output paths."""
    default_local_dir: str = "outputs/checkpoints"
    """Checkpoint root; a run writes under <root>/<project>/<experiment>."""
    resume_mode: str = "auto"
    """auto: resume from the latest checkpoint if any; disable; resume_path: resume_from_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint to resume from when resume_mode is resume_path."""
    max_restarts: int = 0
    """How many times a run that loses a worker, an engine it cannot replace or a host
    restarts itself from its newest checkpoint; 0 stops at the first loss. A restart
    resumes as `resume_mode=auto` does: every prompt is still trained once. Under Ray the
    run restarts in its own process; under torchrun the agent restarts the processes
    (`launch/torchrun.sh` passes this as `--max-restarts`)."""
    restart_backoff_s: float = 10.0
    """Wait before restart n: this × 2^(n-1), at most 300 s (a host that went away may come
    back; Ray needs to see a dead node as dead)."""
    state_timeout_s: float = 1800.0
    """Floor of every state's deadline: a state (GENERATE, TRAIN, SYNC, ...) still running
    after this plus its step's work at ``state_min_tokens_per_s`` is wedged (a peer that
    stopped answering without dying) and fails the run by name, which a restart then picks
    up (docs/launch.md, "Bounded waits")."""
    state_min_tokens_per_s: float = 100.0
    """The slowest rate a state may be said to make progress at: a step's deadline grows by
    its tokens (prompts × samples × longest prompt + response × passes) over this."""
    placement_timeout_s: float = 600.0
    """How long a run waits for its devices: Ray's placement groups, or under torchrun every
    rank of the launch checking in (after a restart: the ranks of a host coming back)."""
    seed: int = 1
    """Global seed (sampling, init); below 2**31 so every RNG it reaches takes it."""


@dataclass
class MegaRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch shapes."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """The model and its three roles: trained actor, rollout engines, frozen reference."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and in-reward KL."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and its process pool."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (``algorithm.adv_estimator=gae`` only)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Cluster shape, task placement, schedule, logging and checkpoints."""


def leaf_types(cls: type = MegaRLConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> type hint of every leaf field of the schema, sections walked into."""
    import dataclasses
    import typing

    out: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out.update(leaf_types(hint, f"{prefix}{name}."))
        else:
            out[prefix + name] = hint
    return out
