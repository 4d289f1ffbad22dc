"""Optimizers for the Megatron backend.

On GPUs, Megatron's own DDP + distributed optimizer (mixed precision, grad buffers). Megatron's
optimizer does not run on the CPU (it asserts `torch.cuda.FloatTensor`), so on the CPU this is
`torch.optim.AdamW` plus what Megatron's optimizer would have done around it: averaging
gradients over data-parallel replicas, summing tied-embedding gradients across the first and
last pipeline stages, and clipping by the global norm over every TP/PP shard (each replicated
tensor counted once).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    use_distributed_optimizer: bool = False

    @classmethod
    def from_config(cls, optim, megatron=None) -> "OptimConfig":
        """From the `actor.optim` (and `actor.megatron`) sections of the run config."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: optim[k] for k in optim if k in names}
        kw["betas"] = tuple(kw.get("betas", cls.betas))
        if megatron is not None:
            kw["use_distributed_optimizer"] = bool(megatron.use_distributed_optimizer)
        return cls(**kw)

    def lr_at(self, step: int) -> float:
        """Linear warm-up to `lr` over `lr_warmup_steps`, then constant."""
        if self.lr_warmup_steps > 0 and step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        return self.lr


def _counts_once(p) -> bool:
    """Whether this rank owns `p` for the global norm (replicas would be counted TP times)."""
    from megatron.core import parallel_state as ps

    if getattr(p, "shared", False) and not ps.is_pipeline_first_stage():
        return False  # tied output layer on the last stage: the embedding already counts it
    return getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


class CpuOptimizer:
    """AdamW with DP gradient averaging, tied-embedding grad sync and TP/PP-aware clipping."""

    def __init__(self, model, cfg: OptimConfig):
        self.model = model
        self.cfg = cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr_at(0), betas=tuple(cfg.betas),
                                     eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.steps = 0

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def _sync_grads(self):
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                    p.grad.div_(dp)
        m = self.model
        if (ps.get_pipeline_model_parallel_world_size() > 1
                and m.share_embeddings_and_output_weights
                and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())):
            w = m.shared_embedding_or_output_weight()
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def grad_norm(self) -> float:
        from megatron.core import parallel_state as ps

        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and _counts_once(p):
                sq += p.grad.double().pow(2).sum()
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
        lr = self.cfg.lr_at(self.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.steps += 1
        return {"grad_norm": norm, "lr": lr}

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        self.steps = sd["steps"]


class GpuOptimizer:
    """Megatron DDP + Megatron optimizer (mixed precision, optional distributed optimizer).

    Not exercised in CI (no GPU there); see the closing notes of the foundation issue.
    """

    def __init__(self, model, cfg: OptimConfig, bf16: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        tcfg = model.config
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.ddp = DistributedDataParallel(tcfg, ddp_cfg, model)
        tcfg.finalize_model_grads_func = finalize_model_grads
        ocfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1], adam_eps=cfg.eps, clip_grad=cfg.clip_grad, bf16=bf16,
            params_dtype=torch.float32, use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.opt = get_megatron_optimizer(ocfg, [self.ddp])
        self.model = model

    def zero_grad(self):
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self) -> dict:
        ok, norm, _ = self.opt.step()
        return {"grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": self.opt.param_groups[0]["lr"], "update_skipped": float(not ok)}

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)


def build_optimizer(model, cfg: OptimConfig, bf16: bool = False):
    if torch.cuda.is_available():
        return GpuOptimizer(model, cfg, bf16)
    return CpuOptimizer(model, cfg)
