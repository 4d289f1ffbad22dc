"""Optimizers for the Megatron backend.

`MegatronOptimizer` is the one users train with on every device: Megatron's DDP (grad buffers,
optionally overlapped grad reduce), `get_megatron_optimizer` (bf16 params with fp32 main params,
optionally the distributed optimizer) and Megatron's LR scheduler. On the CPU it runs through
the accommodations in `_patches.py` (Megatron's optimizer asserts CUDA tensor types), so CI
runs the same optimizer code as a GPU. `TorchOptimizer` (`megatron.optimizer: torch`) is plain
`torch.optim.AdamW` plus what Megatron's optimizer does around it (DP averaging, tied-embedding
grad sync, TP/PP-aware clipping): a fallback should a Megatron release break the CPU path.

Both take the learning rate from Megatron's `OptimizerParamScheduler`: linear warm-up from 0
over `lr_warmup_steps`, then `lr_decay_style` (constant, linear or cosine) down to `min_lr` at
`lr_decay_steps`. Step k (from 0) trains at the schedule's value after k+1 increments, so the
first step of a warm-up already moves the weights (lr/warmup) and the last step of a decay
trains at `min_lr`.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import _patches
from .parallel import has_gloo_groups

IMPLS = ("megatron", "torch")
DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    lr_decay_steps: int | None = None  # required by a decaying style
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    impl: str = "megatron"
    # torch's fused AdamW and a foreach grad norm where neither TE nor Apex is installed
    fused: bool | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"optimizer impl must be one of {IMPLS}, got {self.impl!r}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_decay_style != "constant" and \
                (self.lr_decay_steps or 0) <= self.lr_warmup_steps:
            raise ValueError(f"a {self.lr_decay_style} LR decay needs more schedule steps "
                             f"(lr_decay_steps={self.lr_decay_steps}) than warm-up steps "
                             f"({self.lr_warmup_steps})")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr {self.min_lr} must lie in [0, lr={self.lr}]")

    @classmethod
    def from_config(cls, optim, megatron=None, schedule_steps: int | None = None) -> "OptimConfig":
        """From the `actor.optim` (and `actor.megatron`) sections of the run config.
        `schedule_steps` (the trainer's total steps) is the decay length where
        `optim.total_training_steps` is null."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: optim[k] for k in optim if k in names}
        kw["betas"] = tuple(kw.get("betas", cls.betas))
        kw["lr_decay_steps"] = optim.get("total_training_steps") or schedule_steps
        if megatron is not None:
            kw["use_distributed_optimizer"] = bool(megatron.use_distributed_optimizer)
            kw["overlap_grad_reduce"] = bool(megatron.overlap_grad_reduce)
            kw["impl"] = megatron.optimizer
        return cls(**kw)

    def lr_at(self, step: int) -> float:
        """The learning rate train step `step` (from 0) uses (what the scheduler sets)."""
        sched = _scheduler(_ParamGroups(), self)
        sched.step(step + 1)
        return sched.get_lr({})


class _ParamGroups:
    """An optimizer with one empty parameter group: what the scheduler needs to compute."""

    def __init__(self):
        self.param_groups = [{}]


def _scheduler(optimizer, cfg: OptimConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # A constant schedule has no decay length; Megatron still wants one past the warm-up.
    decay = cfg.lr_decay_steps or cfg.lr_warmup_steps + 1
    decay = max(decay, cfg.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=decay, wd_incr_style="constant")


def _counts_once(p) -> bool:
    """Whether this rank owns `p` for the global norm (replicas would be counted TP times)."""
    from megatron.core import parallel_state as ps

    if getattr(p, "shared", False) and not ps.is_pipeline_first_stage():
        return False  # tied output layer on the last stage: the embedding already counts it
    return getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


class _Scheduled:
    """What both optimizers share: the LR schedule (`self.sched`) and its position."""

    @property
    def steps(self) -> int:
        return self.sched.num_steps

    def resume_schedule(self, steps: int) -> None:
        """Put the LR schedule at `steps`, with this run's settings (not the saved ones), so
        an LR changed on resume takes effect."""
        self.sched.num_steps = 0
        self.sched.step(int(steps))


class TorchOptimizer(_Scheduled):
    """AdamW with DP gradient averaging, tied-embedding grad sync and TP/PP-aware clipping."""

    def __init__(self, model, cfg: OptimConfig):
        self.model = model
        self.cfg = cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                     eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     fused=bool(cfg.fused) or None)
        self.sched = _scheduler(self.opt, cfg)

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def _sync_grads(self):
        from megatron.core import parallel_state as ps

        # over DP × CP, as Megatron's DDP: CP ranks hold partial gradients of one batch,
        # each scaled by CP in Megatron's schedule, so the mean over DP·CP is the DP mean
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        if dp > 1:
            group = ps.get_data_parallel_group(with_context_parallel=True)
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad.div_(dp)
        from megarl.backends.megatron.hf.live import chunks

        # the chunk with the embedding (first stage's first) and the one with the output
        # layer (last stage's last) sum the tied weight's grads; under a virtual pipeline the
        # other chunks of those stages hold neither
        for m in chunks(self.model):
            if (ps.get_pipeline_model_parallel_world_size() > 1
                    and m.share_embeddings_and_output_weights
                    and (m.pre_process or m.post_process)):
                w = m.shared_embedding_or_output_weight()
                if w.grad is None:
                    w.grad = torch.zeros_like(w)
                dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def grad_norm(self) -> float:
        from megatron.core import parallel_state as ps

        grads = [p.grad for p in self.params if p.grad is not None and _counts_once(p)]
        if self.cfg.fused and grads:
            # in fp64 as below, in one call with no host sync per tensor
            norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
            sq = torch.stack(norms).pow(2).sum().cpu()
        else:
            sq = torch.zeros((), dtype=torch.float64)
            for g in grads:
                sq += g.double().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return math.sqrt(sq.item())

    def step(self) -> dict:
        self._sync_grads()
        norm = self.grad_norm()
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.sched.step(1)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        return {"grad_norm": norm, "lr": lr}

    def reload_model_params(self):
        """Nothing to do: AdamW updates the model's own tensors."""

    def state_dict(self):
        return {"impl": "torch", "opt": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, sd):
        _check_impl(sd, "torch")
        self.opt.load_state_dict(sd["opt"])
        if self.cfg.fused:  # a loaded state_dict brings its own param groups' flags
            _fuse_adam(self.opt)
        self.resume_schedule(sd["steps"])


class MegatronOptimizer(_Scheduled):
    """Megatron DDP + Megatron optimizer (mixed precision, optional distributed optimizer and
    overlapped grad reduce) + Megatron's LR scheduler."""

    def __init__(self, model, cfg: OptimConfig, params_dtype: str = "float32"):
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megarl.backends.megatron.hf.live import chunks

        self.cfg = cfg
        self.model = model
        self.params_dtype = params_dtype
        parts = chunks(model)
        tcfg = parts[0].config
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        ocfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
            clip_grad=cfg.clip_grad, bf16=params_dtype == "bfloat16",
            fp16=params_dtype == "float16", params_dtype=torch.float32,
            # fp16 only: Megatron's default first scale (2^32) overflows, and each halving
            # costs a skipped RL step; from 2^16 the tiny model's first step already fits.
            initial_loss_scale=2.0 ** 16,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        with _patches.cuda_tensor_types():
            # one DDP per model chunk; as Megatron-LM does, only the first chunk's grads are
            # bucketed for an overlapped reduce (the others reduce at the end in one go)
            ddps = [DistributedDataParallel(tcfg, ddp_cfg, m, disable_bucketing=i > 0)
                    for i, m in enumerate(parts)]
            # what the schedules run: the one DDP, or the chunks' list under a virtual pipeline
            self.ddp = ddps[0] if len(ddps) == 1 else ddps
            # Megatron's default (True) asks for gloo groups, which on CUDA were never made
            self.opt = get_megatron_optimizer(ocfg, ddps,
                                              use_gloo_process_groups=has_gloo_groups())
        if cfg.fused:
            _fuse_torch_adam(self._parts())
        # The schedules call these: grads reduce after the last micro-batch's backward (and,
        # with overlap, bucket by bucket while the backward still runs), then are finalized.
        tcfg.finalize_model_grads_func = finalize_model_grads
        # fp16's loss scaler: the schedules scale each micro-batch's loss by it before the
        # backward, and the optimizer unscales the grads (and skips a step that overflowed).
        tcfg.grad_scale_func = self.opt.scale_loss
        if cfg.overlap_grad_reduce:
            # the interleaved schedule takes one function per chunk
            tcfg.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
            tcfg.grad_sync_func = ddps[0].start_grad_sync if len(ddps) == 1 else \
                [d.start_grad_sync for d in ddps]
        self.sched = _scheduler(self.opt, cfg)

    def zero_grad(self):
        for d in self.ddp if isinstance(self.ddp, list) else [self.ddp]:
            d.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self) -> dict:
        self.sched.step(1)
        with _patches.cuda_tensor_types():
            ok, norm, _ = self.opt.step()
        return {"grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": self.opt.param_groups[0]["lr"], "update_skipped": float(not ok)}

    def reload_model_params(self):
        """After the model's weights were loaded from elsewhere: copy them into the fp32 main
        params, which the next step would otherwise write back over them."""
        with _patches.cuda_tensor_types():
            self.opt.reload_model_params()

    def _parts(self):
        return getattr(self.opt, "chained_optimizers", [self.opt])

    def state_dict(self):
        sd = {"impl": "megatron", "opt": self.opt.state_dict(), "steps": self.steps,
              "params_dtype": self.params_dtype}
        if self.cfg.use_distributed_optimizer:
            # The distributed optimizer keeps Adam's moments and the main params outside its
            # state_dict: this rank's shard of them, as laid out in its grad buffers.
            sd["param_state"] = [_mark_unpadded(o.get_parameter_state_dp_reshardable())
                                 for o in self._parts()]
        return sd

    def load_state_dict(self, sd):
        _check_impl(sd, "megatron")
        # A bf16 run's state has fp32 main params an fp32 run has not (a GPU run's checkpoint
        # read back by a CPU one, or the reverse): the weights load, the optimizer does not.
        if sd.get("params_dtype", "float32") != self.params_dtype:
            raise ValueError(f"optimizer state was saved with params_dtype="
                             f"{sd.get('params_dtype', 'float32')}; this run has "
                             f"{self.params_dtype}")
        if self.cfg.use_distributed_optimizer != ("param_state" in sd):
            raise ValueError("optimizer state was saved with use_distributed_optimizer="
                             f"{'param_state' in sd}; this run has "
                             f"{self.cfg.use_distributed_optimizer}")
        # no_grad: in fp32 the distributed optimizer's main params are views of the model's
        # leaf params, which an in-place copy under autograd refuses.
        with _patches.cuda_tensor_types(), torch.no_grad():
            self.opt.load_state_dict(sd["opt"])
            for o, state in zip(self._parts(), sd.get("param_state", ())):
                o.load_parameter_state_from_dp_reshardable(state)
        _unshare_adam_steps(self._parts())
        if self.cfg.fused:  # a loaded state_dict brings its own param groups' flags
            _fuse_torch_adam(self._parts())
        self.resume_schedule(sd["steps"])


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's `multi_tensor_l2norm` contract (the norm of all tensors of the first list,
    as a 1-element fp32 tensor) in one `torch._foreach_norm`, on the tensors' device: its
    local fallback (no Apex or TE) takes each tensor's norm to the host, one sync each."""
    grads = tensor_lists[0]
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Megatron's `multi_tensor_scale` contract (dst = src * scale), in place in one call
    where the lists are the same tensors (the grad clip), else one copy per tensor."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _fuse_torch_adam(parts) -> None:
    """Where Megatron fell back to `torch.optim.AdamW` (no TE or Apex), step it with torch's
    fused kernel, and take the grad norm and clip with foreach ops. Set before the first step,
    so Adam's state is made for the fused kernel (its `step` on the params' device). With TE
    or Apex, their fused Adam and multi-tensor kernels are used as they are."""
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER, clip_grads

    if not USING_PYTORCH_OPTIMIZER:
        return
    if clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":
        clip_grads.l2_norm_impl = _foreach_l2_norm
        clip_grads.multi_tensor_scale_impl = _foreach_scale
    for o in parts:
        adam = getattr(o, "optimizer", o)
        if isinstance(adam, torch.optim.AdamW):
            _fuse_adam(adam)


def _fuse_adam(adam: torch.optim.AdamW) -> None:
    """`adam` steps with torch's fused kernel from its next step."""
    adam.defaults.update(fused=True, foreach=False)
    for group in adam.param_groups:
        group.update(fused=True, foreach=False)
    # state loaded from an unfused run: the fused kernel wants fp32 steps on the device
    for p, state in adam.state.items():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def _mark_unpadded(state: dict) -> dict:
    """megatron-core 0.16's `load_parameter_state_from_dp_reshardable` skips entries marked
    `padding`, a key its own `get_parameter_state_dp_reshardable` does not write (only the
    dist-checkpointing path adds it): mark every entry a real parameter."""
    for key, by_dtype in state.items():
        if isinstance(key, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return state


def _unshare_adam_steps(parts) -> None:
    """megatron-core 0.16's distributed optimizer, loading state into torch's Adam (no TE or
    Apex fused Adam), gives every parameter the same `step` tensor; torch increments it once
    per parameter, so after one step the bias correction is off by the parameter count. Give
    each parameter its own counter."""
    for o in parts:
        for state in getattr(o, "optimizer", o).state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _check_impl(sd: dict, impl: str) -> None:
    saved = sd.get("impl", "torch")  # states written before the key existed were AdamW's
    if saved != impl:
        raise ValueError(f"optimizer state was saved by megatron.optimizer={saved}; this run "
                         f"uses {impl}")


def build_optimizer(model, cfg: OptimConfig, params_dtype: str = "float32"):
    if cfg.impl == "torch":
        return TorchOptimizer(model, cfg)
    return MegatronOptimizer(model, cfg, params_dtype)
