"""Write megarl/config/verl_keys.tsv: every leaf key of verl's trainer configs and what megarl
does with it (or, with --check, fail if the file is stale).

    python tools/gen_verl_keys.py [--verl PATH] [--check]

PATH is the directory holding verl's package (default: .venv/verl-ref, where
tools/setup_verl_ref.sh installs verl 0.9.1). The configs read are verl's flattened Megatron
trainer config and its fully-async and one-step-off recipe configs (Megatron and FSDP
variants), each composed as Hydra would: the recipe file merged over the flattened trainer
config its ``defaults:`` list names.

Each key gets one status (megarl/config/verl_keys.py says what the loader does with each):
  works    megarl does it: the same key, or an alias (``target``) of the megarl key that does
  noted    accepted with a start-up warning saying why it has no effect here
  refused  verl's default value is accepted silently; any other value is an error with ``reason``
The rules below decide the status; the first rule whose pattern matches a key wins.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "megarl" / "config" / "verl_keys.tsv"
# tools/setup_verl_ref.sh installs verl beside the environment: this checkout's, or (a git
# worktree sharing one) the running interpreter's
DEFAULT_VERL = next((p for p in (REPO / ".venv" / "verl-ref", Path(sys.prefix) / "verl-ref")
                     if p.is_dir()), REPO / ".venv" / "verl-ref")

# (short name, recipe file or None, flattened trainer config it composes onto)
CONFIGS = (
    ("megatron", None, "trainer/config/_generated_ppo_megatron_trainer.yaml"),
    ("fully_async_megatron", "experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml",
     "trainer/config/_generated_ppo_megatron_trainer.yaml"),
    ("fully_async_fsdp", "experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml",
     "trainer/config/_generated_ppo_trainer.yaml"),
    ("one_step_off_megatron", "experimental/one_step_off_policy/config/one_step_off_ppo_megatron_trainer.yaml",
     "trainer/config/_generated_ppo_megatron_trainer.yaml"),
    ("one_step_off_fsdp", "experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml",
     "trainer/config/_generated_ppo_trainer.yaml"),
)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and value and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:  # an empty mapping is a leaf: verl's open dicts (override_config: {})
            yield f"{prefix}{key}", value


def compose(verl_root: str | os.PathLike) -> dict[str, dict[str, object]]:
    """{config short name: {dotted leaf key: verl's default}} for each config in CONFIGS."""
    pkg = Path(verl_root) / "verl"

    def read(rel: str) -> dict:
        with open(pkg / rel) as fh:
            return yaml.safe_load(fh) or {}

    out = {}
    for name, recipe, base in CONFIGS:
        tree = read(base)
        if recipe:
            own = {k: v for k, v in read(recipe).items() if k not in ("hydra", "defaults")}
            tree = _merge(tree, own)
        out[name] = dict(_flatten(tree))
    return out


# --- the rules -----------------------------------------------------------------------------
# Aliases: verl's key -> the megarl key that does the same thing.
ALIAS = {
    "actor_rollout_ref.actor.megatron.dtype": "actor_rollout_ref.actor.megatron.params_dtype",
    "actor_rollout_ref.ref.megatron.dtype": "actor_rollout_ref.ref.megatron.params_dtype",
    "critic.megatron.dtype": "critic.megatron.params_dtype",
    "actor_rollout_ref.actor.megatron.router_replay.mode": "actor_rollout_ref.actor.router_replay.mode",
    "actor_rollout_ref.rollout.response_length": "actor_rollout_ref.rollout.max_new_tokens",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb",
    "async_training.partial_rollout": "actor_rollout_ref.rollout.partial_rollout",
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",  # FSDP's name
    "critic.grad_clip": "critic.optim.clip_grad",
    # the FSDP configs' name for the schedule after warmup (constant / cosine), megarl's too
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor_rollout_ref.actor.optim.lr_decay_style",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_decay_style",
}
# Keys megarl reads through a rule of megarl/config/verl_keys.py, not one alias. The text says
# what the rule sets; it always has a space, which is how the table tells it from an alias.
DERIVED = {
    "custom_reward_function.path": "reward.reward_fn (path:name)",
    "custom_reward_function.name": "reward.reward_fn (path:name)",
    "reward.custom_reward_function.path": "reward.reward_fn (path:name)",
    "reward.custom_reward_function.name": "reward.reward_fn (path:name)",
    "rollout.nnodes": "trainer.separated_node_tasks/ratios, trainer.nnodes (layout)",
    "rollout.n_gpus_per_node": "trainer.separated_node_tasks/ratios, trainer.n_gpus_per_node (layout)",
    "async_training.staleness_threshold": "trainer.generate_ahead_steps (2 + ceil(threshold))",
    "async_training.trigger_parameter_sync_step":
        "data.train_batch_size (ppo_mini_batch_size x require_batches x trigger_parameter_sync_step)",
    "async_training.require_batches":
        "data.train_batch_size (ppo_mini_batch_size x require_batches x trigger_parameter_sync_step)",
}

_OFFLOAD = ("megarl keeps parameters, gradients and optimizer state on the device; for less memory "
            "per device raise megatron.tensor_model_parallel_size / pipeline_model_parallel_size "
            "or keep megatron.use_distributed_optimizer=true")
_PROFILE = ("megarl has no per-worker profiler hooks; it writes its own timeline trace "
            "(trainer.timeline_freq) and timing/* metrics")
_FSDP = "an FSDP setting: megarl trains with Megatron-core only"
_FAST_PATHS = ("megarl's fast paths are keys of their own: actor.entropy_from_logits_with_chunking, "
               "megatron.override_transformer_config.bias_{activation,dropout}_fusion, optim.fused")
_VLLM = "an inference-engine knob of verl's vLLM/SGLang launcher; megarl starts SGLang itself"
_TARGET = "verl's Hydra class path; megarl builds its own config objects"

# (pattern, status, reason). First match wins; fnmatch's * spans dots.
RULES: list[tuple[str, str, str]] = [
    ("*._target_", "noted", _TARGET),
    ("*.profiler.*", "noted", _PROFILE),
    ("global_profiler.*", "noted", _PROFILE),
    ("*npu_profile*", "noted", _PROFILE),
    ("*.fsdp_config.*", "noted", _FSDP),
    ("*.fsdp.*", "noted", _FSDP),
    ("*.ulysses_sequence_parallel_size", "refused",
     "Ulysses sequence parallelism is FSDP's; megarl splits sequences with Megatron's TP "
     "sequence parallel (on whenever tensor_model_parallel_size > 1)"),
    ("*use_remove_padding", "noted",
     "megarl always packs sequences without padding (THD layout); there is nothing to turn off"),
    ("*.megatron.param_offload", "refused", "parameter offload: " + _OFFLOAD),
    ("*.megatron.grad_offload", "refused", "gradient offload: " + _OFFLOAD),
    ("*.megatron.optimizer_offload", "refused", "optimizer offload: " + _OFFLOAD),
    ("*.megatron.sequence_parallel", "noted",
     "megarl turns Megatron's sequence parallel on whenever tensor_model_parallel_size > 1"),
    ("*.megatron.use_dist_checkpointing", "refused",
     "megarl reads HF weights (actor_rollout_ref.model.path) and its own checkpoints; "
     "convert a Megatron dist checkpoint with tools/convert_megatron_to_hf.py"),
    ("*.megatron.dist_checkpointing_*", "noted", "megarl does not load Megatron dist checkpoints"),
    ("*.megatron.dist_ckpt_*", "noted", "megarl does not load Megatron dist checkpoints"),
    ("*.megatron.distrib_optim_fully_reshardable_mem_efficient", "noted",
     "megarl saves the distributed optimizer in its own resharding format"),
    ("*entropy_checkpointing", "noted", "megarl computes entropy in its fused log-prob pass"),
    ("*.pad_to_length", "noted", "megarl packs sequences (THD), it does not pad to a length"),
    ("actor_rollout_ref.actor.use_rollout_log_probs", "noted",
     "megarl always keeps the engine's log-probs as the behaviour policy and recomputes the "
     "proximal one (LOGP); bypass_mode is algorithm.rollout_correction.bypass_mode"),
    ("*.lora_adapter_path", "refused", "megarl trains full weights; it has no LoRA"),
    ("*.megatron.use_mbridge", "noted", "megarl maps HF weights to Megatron with its own tables (megarl/convert)"),
    ("*.megatron.vanilla_mbridge", "noted", "megarl maps HF weights to Megatron with its own tables (megarl/convert)"),
    ("*.megatron.override_transformer_config.recompute_modules", "refused",
     "megarl recomputes whole layers (recompute_granularity=full) or core attention (selective); "
     "a module list is not read"),
    ("*.megatron.override_transformer_config.*", "refused",
     "megarl passes only the recompute_*, moe_* and attention_backend transformer settings through"),
    ("*.megatron.override_ddp_config", "refused", "megarl sets Megatron's DDP config itself"),
    ("*.megatron.override_mcore_model_config", "refused",
     "megarl builds the Megatron model from the HF config; use actor_rollout_ref.model.override_config"),
    ("*.megatron.router_replay.*", "refused", "megarl's router replay is actor.router_replay.mode only"),
    ("*.megatron.qat.enable", "refused", "megarl has no quantization-aware training"),
    ("*.megatron.qat.*", "noted", "megarl has no quantization-aware training"),
    ("*.qat.enable", "refused", "megarl has no quantization-aware training"),
    ("*.qat.*", "noted", "megarl has no quantization-aware training"),
    ("actor_rollout_ref.rollout.qat", "noted", "megarl has no quantization-aware training"),
    ("*.megatron.use_megatron_fsdp", "refused", "megarl uses Megatron's DDP / distributed optimizer, not Megatron-FSDP"),
    ("*.megatron.dynamic_context_parallel", "refused",
     "megarl's context parallelism is static (megatron.context_parallel_size)"),
    ("*.megatron.max_seqlen_per_dp_cp_rank", "noted",
     "megarl's token budgets (ppo_max_token_len_per_gpu) count per CP rank"),
    ("*.megatron.pad_*", "noted", "megarl packs sequences (THD), it does not pad to a length"),
    ("*.megatron.forward_only", "noted", "megarl knows which models only run forward (ref, logp)"),
    ("*entropy_from_logits_with_chunking", "noted",
     "megarl's reference follows actor_rollout_ref.actor.entropy_from_logits_with_chunking"),
    ("*entropy_from_logits_chunk_size", "noted",
     "megarl's reference follows actor_rollout_ref.actor.entropy_from_logits_chunk_size"),
    ("*.optim.optimizer", "refused", "megarl trains with Megatron's Adam (megatron.optimizer)"),
    ("*.optim.muon_*", "noted", "Muon's settings; megarl trains with Adam"),
    ("*.optim.lr_warmup_steps_ratio", "refused",
     "megarl's warmup is optim.lr_warmup_steps (a number of steps)"),
    ("*.optim.lr_warmup_init", "refused", "megarl's warmup starts from 0"),
    ("*.optim.lr_decay_steps", "noted", "megarl decays over optim.total_training_steps"),
    ("*.optim.lr_wsd_*", "noted", "megarl has no warmup-stable-decay schedule"),
    ("*.optim.weight_decay_incr_style", "refused", "megarl's weight decay is constant"),
    ("*.optim.use_checkpoint_opt_param_scheduler", "noted",
     "megarl restores the scheduler from its own checkpoint on resume"),
    ("*.optim.use_precision_aware_optimizer", "refused", "megarl keeps fp32 optimizer state"),
    ("*.optim.main_grads_dtype", "refused", "megarl keeps fp32 gradients for the optimizer"),
    ("*.optim.exp_avg_dtype", "refused", "megarl keeps fp32 optimizer state"),
    ("*.optim.exp_avg_sq_dtype", "refused", "megarl keeps fp32 optimizer state"),
    ("*.optim.use_layer_wise_distributed_optimizer", "refused",
     "megarl shards the optimizer with megatron.use_distributed_optimizer"),
    ("*.optim.override_optimizer_config", "refused", "megarl sets Megatron's optimizer config from optim.*"),
    ("*.optim.min_lr_ratio", "refused", "megarl's floor is optim.min_lr, a learning rate, not a ratio"),
    ("*.optim.warmup_style", "refused", "verl's old name of lr_scheduler_type; megarl's is optim.lr_decay_style"),
    ("*.optim.num_cycles", "noted", "the cosine schedule's cycles; megarl's cosine decays once"),
    ("*.optim.optimizer_impl", "refused", "megarl trains with Megatron's Adam (megatron.optimizer)"),
    ("*.optim.zero_indexed_step", "noted", "a torch scheduler's step numbering; megarl counts steps itself"),
    ("*.optim.*", "refused", "megarl's optimizer takes the optim.* keys of its schema only"),
    ("*.checkpoint.async_save", "refused",
     "megarl writes checkpoints in the background already (the CHECKPOINT state)"),
    ("*.checkpoint.*", "noted", "megarl saves and loads the model, optimizer and run state, always all"),
    ("*.rollout_n", "noted", "verl's copy of rollout.n; megarl reads actor_rollout_ref.rollout.n"),
    ("*.ppo_micro_batch_size", "refused",
     "a global micro-batch size (deprecated in verl); use ppo_micro_batch_size_per_gpu"),
    ("*.log_prob_micro_batch_size", "refused",
     "a global micro-batch size (deprecated in verl); use log_prob_micro_batch_size_per_gpu"),
    ("*.forward_micro_batch_size", "refused",
     "a global micro-batch size (deprecated in verl); use forward_micro_batch_size_per_gpu"),
    ("*.use_torch_compile", "noted", "megarl does not torch.compile the trainer's functions"),
    ("*use_fused_kernels", "noted", _FAST_PATHS),
    ("*.fused_kernel_options.*", "noted", _FAST_PATHS),
    ("*.freeze_vision_tower", "noted", "megarl trains text models"),
    ("*.calculate_entropy", "noted", "megarl reports actor/entropy every step"),
    ("*.calculate_sum_pi_squared", "refused", "megarl does not compute sum(pi^2) (verl's optimal-baseline estimators)"),
    ("*.use_prefix_grouper", "refused", "megarl has no shared-prefix grouping of samples"),
    ("actor_rollout_ref.actor.shuffle", "refused", "megarl does not shuffle within a step's mini-batches"),
    ("actor_rollout_ref.actor.data_loader_seed", "noted", "megarl seeds its data with data.seed"),
    ("*.lora.*", "refused", "megarl trains full weights; it has no LoRA"),
    ("*.lora_rank", "refused", "megarl trains full weights; it has no LoRA"),
    ("*.lora_alpha", "refused", "megarl trains full weights; it has no LoRA"),
    ("*.target_modules", "noted", "LoRA's target modules; megarl has no LoRA"),
    ("*.exclude_modules", "noted", "LoRA's excluded modules; megarl has no LoRA"),
    ("*.mtp.enable*", "refused", "megarl has no multi-token prediction"),
    ("*.mtp.*", "noted", "multi-token prediction's settings; megarl has none"),
    ("*.tiled_mlp.enabled", "refused", "megarl has no tiled MLP"),
    ("*.tiled_mlp.*", "noted", "megarl has no tiled MLP"),
    ("*.use_shm", "noted", "megarl reads the model and data from the path given"),
    ("*.external_lib", "refused", "megarl imports no extra model library; the model must be one megarl/convert maps"),
    ("*.custom_chat_template", "refused", "megarl uses the tokenizer's own chat template"),
    ("*.enable_activation_offload", "refused", "megarl does not offload activations; use recompute_* to save memory"),
    ("*.use_liger", "noted", "Liger kernels are FSDP-side; megarl trains with Megatron"),
    ("actor_rollout_ref.hybrid_engine", "noted",
     "megarl places generation by trainer.separated_node_tasks: sharing a group is verl's hybrid engine"),
    ("actor_rollout_ref.nccl_timeout", "noted", "megarl's weight-sync deadline is rollout.weight_sync_timeout_s"),
    ("actor_rollout_ref.ref.strategy", "noted", "megarl's reference model is always Megatron"),
    # rollout
    ("actor_rollout_ref.rollout.mode", "refused", "megarl's rollout is always asynchronous (the server API)"),
    ("actor_rollout_ref.rollout.nnodes", "noted",
     "verl's standalone-rollout size; megarl sizes generation by trainer.separated_node_ratios"),
    ("actor_rollout_ref.rollout.n_gpus_per_node", "noted",
     "verl's standalone-rollout size; megarl sizes generation by trainer.separated_node_ratios"),
    ("actor_rollout_ref.rollout.full_determinism", "refused", "megarl does not ask SGLang for deterministic inference"),
    ("actor_rollout_ref.rollout.seed", "noted", "the engines' sampling seed; megarl seeds with trainer.seed"),
    ("actor_rollout_ref.rollout.prompt_length", "noted", "megarl reads data.max_prompt_length"),
    ("actor_rollout_ref.rollout.ignore_eos", "refused", "megarl always stops at the end-of-sequence token"),
    ("actor_rollout_ref.rollout.do_sample", "refused",
     "megarl samples in training (temperature > 0); greedy is val_kwargs.do_sample=false"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "noted",
     "megarl always takes the engine's log-probs (they are the behaviour policy)"),
    ("actor_rollout_ref.rollout.free_cache_engine", "noted", "megarl's engines keep their KV cache between steps"),
    ("actor_rollout_ref.rollout.data_parallel_size", "noted",
     "megarl runs one engine per rollout.tensor_model_parallel_size devices of the generate group"),
    ("actor_rollout_ref.rollout.expert_parallel_size", "refused", "megarl's engines have no expert parallelism setting"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "refused", "megarl's engines are tensor-parallel only"),
    ("actor_rollout_ref.rollout.over_sample_rate", "refused",
     "megarl's over-sampling is rollout.over_sample_prompts (whole prompts, with partial rollout)"),
    ("actor_rollout_ref.rollout.layered_summon", "noted", "FSDP's weight gathering; megarl broadcasts buckets"),
    ("actor_rollout_ref.rollout.load_format", "noted", "megarl's engines load real weights, then take updates"),
    ("actor_rollout_ref.rollout.logprobs_mode", "refused",
     "megarl takes the engine's processed log-probs (after temperature)"),
    ("actor_rollout_ref.rollout.engine_kwargs.*", "noted",
     _VLLM + "; pass SGLang's arguments with rollout.server_extra_args"),
    ("actor_rollout_ref.rollout.multi_turn.*", "refused",
     "megarl's tool calling is multi_turn.{enable,tools,format,...}; this setting is not read"),
    ("actor_rollout_ref.rollout.agent.*", "refused",
     "megarl has no agent-loop registry; its rollout function is rollout.rollout_fn"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backend", "noted",
     "megarl sends weights over NCCL (or gloo on CPU): rollout.update_group_backend"),
    ("actor_rollout_ref.rollout.checkpoint_engine.*", "noted", "megarl's weight sync has its own settings (rollout.param_update_*)"),
    ("actor_rollout_ref.rollout.trace.*", "noted", "megarl has no rollout tracing backend (weave/mlflow traces)"),
    ("actor_rollout_ref.rollout.prometheus.*", "noted", "megarl exports no Prometheus metrics"),
    ("actor_rollout_ref.rollout.disaggregation.enabled", "refused", "megarl has no prefill/decode disaggregation"),
    ("actor_rollout_ref.rollout.disaggregation.*", "noted", "megarl has no prefill/decode disaggregation"),
    ("actor_rollout_ref.rollout.quantization", "refused", "megarl's engines run the trainer's dtype unquantized"),
    ("actor_rollout_ref.rollout.quantization_config_file", "refused", "megarl's engines run unquantized"),
    ("actor_rollout_ref.rollout.router_config_path", "noted", "megarl balances requests over its engines itself"),
    ("actor_rollout_ref.rollout.standalone_gpu_memory_utilization", "noted",
     "megarl reads rollout.gpu_memory_utilization"),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", "noted", "megarl sends token ids; the engines never detokenize"),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", "noted", "megarl reports no engine MoE load metrics"),
    ("actor_rollout_ref.rollout.*", "noted", _VLLM),
    # data
    ("data.tokenizer", "noted", "megarl's tokenizer is actor_rollout_ref.model.tokenizer_path"),
    ("data.train_max_samples", "refused", "megarl reads every row of the train files"),
    ("data.val_max_samples", "refused", "megarl reads every row of the validation files"),
    ("data.gen_batch_size", "noted", "megarl draws prompts in batches of data.train_batch_size"),
    ("data.return_raw_input_ids", "noted", "megarl tokenizes once, with the model's tokenizer"),
    ("data.return_full_prompt", "noted", "megarl keeps the prompt it sent with each sample"),
    ("data.dataloader_num_workers", "noted", "megarl loads the data in the driver"),
    ("data.validation_shuffle", "noted", "megarl validates in file order"),
    ("data.filter_overlong_prompts_workers", "noted", "megarl filters in one process"),
    ("data.trust_remote_code", "noted", "megarl reads actor_rollout_ref.model.trust_remote_code"),
    ("data.custom_cls.path", "refused", "megarl has no custom dataset class; rows are verl-format parquet or JSONL"),
    ("data.custom_cls.*", "noted", "megarl has no custom dataset class"),
    ("data.*_key", "refused", "megarl trains on text prompts; this column is not read"),
    ("data.image_patch_size", "noted", "megarl trains text models"),
    ("data.return_multi_modal_inputs", "noted", "megarl trains text models"),
    ("data.mm_processor_kwargs", "refused", "megarl trains text models"),
    ("data.tool_config_path", "noted", "megarl's tools are rollout.multi_turn.tools"),
    ("data.function_tool_path", "noted", "megarl's tools are rollout.multi_turn.tools"),
    ("data.apply_chat_template_kwargs", "refused", "megarl applies the chat template with no extra arguments"),
    ("data.return_raw_chat", "noted", "megarl renders the chat template itself"),
    ("data.reward_fn_key", "refused", "megarl picks the scorer by the data_source column"),
    ("data.datagen.*", "refused", "megarl has no dynamic data generation"),
    ("data.sampler.*", "refused", "megarl's sampler is data.shuffle with data.seed"),
    # rewards
    ("sandbox_fusion.*", "refused", "megarl runs code rewards in its own sandbox (megarl/reward)"),
    ("reward.sandbox_fusion.*", "refused", "megarl runs code rewards in its own sandbox (megarl/reward)"),
    ("reward.reward_manager.*", "refused",
     "megarl has one streaming reward pool; DAPO's overlong penalty is reward.reward_kwargs.overlong_buffer_cfg"),
    ("reward_model.reward_manager", "refused",
     "megarl has one reward pool: naive, or dapo's overlong penalty (reward.reward_kwargs.overlong_buffer_cfg)"),
    ("reward.reward_manager.name", "refused",
     "megarl has one reward pool: naive, or dapo's overlong penalty (reward.reward_kwargs.overlong_buffer_cfg)"),
    ("reward_model.*", "refused", "megarl has no model-based reward; rewards are functions (reward.reward_fn)"),
    ("reward.reward_model.*", "refused", "megarl has no model-based reward; rewards are functions (reward.reward_fn)"),
    ("reward.num_workers", "noted", "megarl's reward pool size"),
    ("reward.reward_kwargs.*", "refused", "megarl's reward_kwargs are overlong_buffer_cfg and max_resp_len"),
    ("reward.*", "refused", "megarl's reward settings are reward.{reward_fn,num_workers,timeout_s,failure_score}"),
    ("distillation.*", "refused", "megarl has no on-policy distillation"),
    # algorithm
    ("algorithm.filter_groups.max_inflight_gen_batches", "noted",
     "megarl's extra generation is bounded by filter_groups.max_num_gen_batches"),
    ("algorithm.use_pf_ppo", "refused", "megarl has no preference-feedback PPO reweighting"),
    ("algorithm.pf_ppo.*", "noted", "megarl has no preference-feedback PPO reweighting"),
    ("algorithm.rollout_correction.*", "refused",
     "megarl's rollout correction is rollout_is(_threshold, _batch_normalize), rollout_rs(_threshold), bypass_mode, loss_type"),
    ("algorithm.*", "refused", "not among megarl's algorithm settings"),
    # critic
    ("critic.rollout_n", "noted", "verl's copy of rollout.n"),
    ("critic.enable", "refused", "megarl runs a critic exactly when algorithm.adv_estimator=gae"),
    ("critic.nccl_timeout", "noted", "megarl's critic has no collective deadline of its own"),
    ("critic.model.*", "refused", "megarl's critic reads critic.model.path (initialised from the actor's model when null)"),
    ("critic.*", "refused", "not among megarl's critic settings"),
    # trainer
    ("trainer.balance_batch", "noted", "megarl balances micro-batches by tokens (use_dynamic_bsz)"),
    ("trainer.rollout_data_dir", "noted", "megarl writes trained prompts to trained_prompts.jsonl in the run directory"),
    ("trainer.validation_data_dir", "noted", "megarl logs validation rows with trainer.log_val_generations"),
    ("trainer.esi_redundant_time", "noted", "megarl has no elastic-instance deadline"),
    ("trainer.checkpoint_callback_class", "refused", "megarl has no checkpoint callbacks"),
    ("trainer.default_hdfs_dir", "refused", "megarl writes checkpoints to trainer.default_local_dir only"),
    ("trainer.del_local_ckpt_after_load", "refused", "megarl keeps checkpoints; trainer.max_actor_ckpt_to_keep prunes"),
    ("trainer.max_critic_ckpt_to_keep", "noted", "megarl keeps the critic with the actor (trainer.max_actor_ckpt_to_keep)"),
    ("trainer.ray_wait_register_center_timeout", "noted", "megarl's placement deadline is trainer.placement_timeout_s"),
    ("trainer.use_legacy_worker_impl", "noted", "verl's worker implementation switch"),
    ("trainer.use_v1", "noted", "verl's trainer implementation switch"),
    ("trainer.v1.*", "refused", "verl's v1 trainer; megarl's layout is trainer.separated_node_tasks/ratios"),
    ("trainer.*", "refused", "not among megarl's trainer settings"),
    # the async recipes' own keys
    ("rollout.n", "noted", "megarl's samples per prompt are actor_rollout_ref.rollout.n"),
    ("rollout.total_rollout_steps", "noted", "megarl runs trainer.total_training_steps (or total_epochs)"),
    ("rollout.*", "refused", "not among the recipe settings megarl reads"),
    ("async_training.use_trainer_do_validate", "noted", "megarl validates on the generate group"),
    ("async_training.use_dynamic_resource_scheduling", "refused",
     "megarl's groups are fixed for the run (trainer.separated_node_ratios)"),
    ("async_training.dynamic_schedule_*", "noted", "megarl's groups are fixed for the run"),
    ("async_training.concurrent_samples_per_replica", "noted", "megarl sends every prompt of a step to its engines at once"),
    ("async_training.*", "refused", "not among the async settings megarl reads"),
    # infrastructure megarl does its own way
    ("ray_kwargs.*", "noted", "megarl starts or joins Ray itself (trainer.launcher, launch/)"),
    ("transfer_queue.*", "noted", "megarl moves samples through its own buffer"),
    ("skip.*", "noted", "verl's step-skipping debug switches"),
    ("model_engine", "noted", "megarl trains with Megatron; there is no engine choice"),
]
# Keys verl's own example and recipe scripts still pass that 0.9.1's YAML no longer lists (its
# launchers add them with ``+``): (key, verl's default, status, megarl key or reason).
LEGACY = [
    ("reward_model.reward_kwargs.overlong_buffer_cfg.enable", False, "works",
     "reward.reward_kwargs.overlong_buffer_cfg.enable"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.len", 0, "works",
     "reward.reward_kwargs.overlong_buffer_cfg.len"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", 1.0, "works",
     "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.log", False, "works",
     "reward.reward_kwargs.overlong_buffer_cfg.log"),
    ("reward_model.reward_kwargs.max_resp_len", None, "works", "reward.reward_kwargs.max_resp_len"),
    ("actor_rollout_ref.actor.megatron.grad_offload", False, "refused", "gradient offload: " + _OFFLOAD),
    ("actor_rollout_ref.ref.megatron.grad_offload", False, "refused", "gradient offload: " + _OFFLOAD),
    ("critic.megatron.grad_offload", False, "refused", "gradient offload: " + _OFFLOAD),
    ("rollout.total_epochs", None, "noted", "megarl runs trainer.total_epochs"),
    ("rollout.test_freq", None, "noted", "megarl validates at trainer.test_freq"),
    ("async_training.use_rollout_log_probs", True, "noted",
     "megarl always keeps the engine's log-probs as the behaviour policy"),
    ("trainer.use_legacy_worker_impl", "auto", "noted", "verl's worker implementation switch"),
] + [
    # Megatron TransformerConfig fields under verl's open mapping. Kernel and fusion switches
    # that verl's scripts pass change speed, not results: megarl chooses those itself. Any
    # other field (moe_router_topk, a shape) would change the model: a key ending in * governs
    # every sub-key not listed, and refuses it.
    (f"{s}.megatron.override_transformer_config.{f}", None, "noted",
     "a Megatron kernel/fusion switch; megarl chooses its kernels itself")
    for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
    # bias_activation_fusion and bias_dropout_fusion are megarl's keys (schema.py)
    for f in ("apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion",
              "deallocate_pipeline_outputs",
              "persist_layer_norm", "moe_grouped_gemm", "moe_permute_fusion", "moe_enable_deepep")
] + [
    (f"{s}.megatron.override_transformer_config.{f}", None, "works",
     f"{s}.megatron.override_transformer_config.{f}")
    for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
    for f in ("bias_activation_fusion", "bias_dropout_fusion")
] + [
    (f"{s}.megatron.override_transformer_config.*", {}, "refused",
     "megarl passes only the recompute_*, bias_{activation,dropout}_fusion and "
     "moe_{aux_loss_coeff,z_loss_coeff,expert_capacity_"
     "factor,token_drop_policy,token_dispatcher_type} transformer settings through; the model's "
     "shape comes from its HF config")
    for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
]
# Values accepted beside verl's default for a refused key, because megarl does the same.
EXTRA_ACCEPTED = {
    # megarl's pool applies DAPO's overlong penalty whenever overlong_buffer_cfg.enable is set
    "reward_model.reward_manager": ["naive", "dapo"],
    "reward.reward_manager.name": ["naive", "dapo"],
}
# works keys whose verl default means "not set" (verl derives the value, or has no limit): given
# with that value, megarl's own default stands; megarl's schema would refuse the value itself.
UNSET_DEFAULTS = (
    "*.optim.total_training_steps", "*.optim.lr_warmup_steps", "*micro_batch_size_per_gpu",
    "*max_token_len_per_gpu", "data.seed", "*.multi_turn.max_assistant_turns",
    "*.multi_turn.max_parallel_calls", "*.multi_turn.max_tool_response_length",
    "actor_rollout_ref.rollout.name",  # Hydra's ??? (required) in the FSDP configs
)
# A works key that refuses some values, with why (the key's other values pass to the schema).
REFUSE_VALUES = {
    "actor_rollout_ref.rollout.name": (["vllm", "trtllm", "hf"],
        "megarl generates with SGLang (rollout.name=sglang) or its embedded engine (embedded); "
        "it has no vLLM/TensorRT-LLM/HF rollout"),
    "actor_rollout_ref.actor.strategy": (["fsdp", "fsdp2"], "megarl trains with Megatron-core only (strategy=megatron)"),
    "critic.strategy": (["fsdp", "fsdp2"], "megarl trains with Megatron-core only (strategy=megatron)"),
}


def classify(key: str, leaves: set[str], sections: set[str]) -> tuple[str, str, str]:
    """(status, megarl key or '', reason) of one verl key."""
    if key in ALIAS:
        return "works", ALIAS[key], ""
    if key in DERIVED:
        return "works", DERIVED[key], ""
    if key in leaves or key in sections:
        refuse = REFUSE_VALUES.get(key)
        return "works", key, refuse[1] if refuse else ""
    for pattern, status, reason in RULES:
        if fnmatch.fnmatchcase(key, pattern):
            return status, "", reason
    return "refused", "", "megarl has no such setting"


def table(verl_root) -> str:
    from megarl.config.loader import _LEAVES, _SECTIONS  # the megarl keys of this checkout

    leaves, sections = set(_LEAVES), set(_SECTIONS)
    configs = compose(verl_root)
    rows: dict[str, dict] = {}
    for name, keys in configs.items():
        for key, default in keys.items():
            row = rows.setdefault(key, {"defaults": [], "in": []})
            if default not in row["defaults"]:  # the FSDP configs' defaults differ for a few
                row["defaults"].append(default)
            row["in"].append(name)
    for key, default, _, _ in LEGACY:
        rows.setdefault(key, {"defaults": [default], "in": ["legacy"]})
    for key, extra in EXTRA_ACCEPTED.items():
        rows[key]["defaults"] += [v for v in extra if v not in rows[key]["defaults"]]
    legacy = {key: (status, target) for key, _, status, target in LEGACY}
    lines = ["# generated by tools/gen_verl_keys.py from verl's trainer configs; do not edit\n",
             "key\tstatus\tmegarl\treason\tverl_defaults\trefuse_values\tunset\tconfigs\n"]
    for key in sorted(rows):
        status, target, reason = classify(key, leaves, sections)
        if key in legacy:
            status, text = legacy[key]
            target, reason = (text, "") if status == "works" else ("", text)
        defaults = rows[key]["defaults"]
        if status == "refused" and any(isinstance(d, str) and "${" in d for d in defaults):
            # verl copies it from another key, so its value is that key's: no default to compare
            status, reason = "noted", reason + "; verl derives it from another key"
        unset = status == "works" and any(fnmatch.fnmatchcase(key, p) for p in UNSET_DEFAULTS)
        refuse = json.dumps(REFUSE_VALUES[key][0]) if key in REFUSE_VALUES else ""
        default = json.dumps(defaults)
        lines.append("\t".join((key, status, target, reason, default, refuse, "1" if unset else "",
                                ",".join(rows[key]["in"]))) + "\n")
    return "".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verl", default=str(DEFAULT_VERL), help="directory holding verl's package")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is out of date")
    a = ap.parse_args()
    text = table(a.verl)
    if a.check:
        if not TABLE.is_file() or TABLE.read_text() != text:
            print(f"{TABLE} is stale: run python tools/gen_verl_keys.py", file=sys.stderr)
            return 1
        return 0
    tmp = TABLE.with_name(f".{TABLE.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, TABLE)
    counts = {}
    for line in text.splitlines()[2:]:
        counts[line.split("\t")[1]] = counts.get(line.split("\t")[1], 0) + 1
    print(f"wrote {TABLE}: {len(text.splitlines()) - 2} keys, {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
