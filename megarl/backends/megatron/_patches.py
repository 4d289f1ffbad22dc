"""Every CPU accommodation Megatron-core needs, in one place. Targets megatron-core 0.16.x.

Megatron-core assumes CUDA in a few spots that matter for us (verified on 0.16.1, torch 2.13
CPU, gloo):
- `torch.cuda.current_device()` is used as a device argument when allocating buffers;
- `torch.cuda.synchronize()` is called around pipeline communication;
- `pipeline_parallel/schedules.py` counts tokens in `torch.zeros(..., device="cuda")`;
- `LanguageModule.setup_embeddings_and_output_layer` moves the tied embedding to `.cuda()`
  before syncing it across the first and last pipeline stages;
- activation recompute (`tensor_parallel.random.CheckpointFunction`, what
  `enable_gradient_checkpointing` turns on) saves and restores the CUDA generator's state
  around each recomputed layer: on the CPU there is none, and the CPU generator's state, which
  it saves and restores as well, is the one that matters;
- sequence parallelism runs the decoder inside `get_cuda_rng_tracker().fork()`, which swaps
  CUDA generator states that a CPU process has none of (`cpu_rng_tracker`);
- context parallelism's RoPE slice (`rope_utils.get_pos_emb_on_this_cp_rank`) builds its
  chunk index in pinned memory and moves it with `.cuda()`: `_pos_emb_on_this_cp_rank` is the
  same slice on the CPU.
Sequence parallelism needs no collective beyond gloo's: torch's gloo backend has
`reduce_scatter_tensor` (since torch 2.2: an all-reduce, then each rank keeps its chunk, so
exactly the sums the all-reduce without SP makes; asynchronous since 2.3) and
`all_gather_into_tensor`, the two that Megatron's SP mappings and linears call; megarl admits
torch >= 2.6 (tests/unit/backends/test_gloo_sp_collectives.py checks them exact).
`apply()` redirects those to the CPU. It is a no-op when CUDA is available, so GPU runs use
Megatron exactly as shipped.

Megatron's optimizer (`megatron.optimizer: megatron`, what GPUs run) needs two more: its
modules allocate scalars on "cuda" (the same redirect), and it asserts or branches on
`tensor.type()` naming a CUDA type (`torch.cuda.FloatTensor`, `torch.cuda.BFloat16Tensor`):
`cuda_tensor_types()` answers those names for CPU tensors while the optimizer runs. The core attention (the local spec's allocates on `cuda`) is
replaced through the layer spec instead, see `attention.py`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types

import torch

logger = logging.getLogger(__name__)

TARGET_MEGATRON_CORE = "0.16"
_applied = False


class _CpuTorchShim(types.ModuleType):
    """Stands in for the `torch` name inside one Megatron module: allocations that ask for
    "cuda" land on the CPU; everything else is torch itself."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            def on_cpu(*args, _fn=attr, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _fn(*args, **kwargs)
            return on_cpu
        return attr


def _tensor_cuda_is_identity(fn):
    """Run `fn` with `Tensor.cuda()` returning the tensor itself (CPU-only process)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved
    return wrapper


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron-core 0.16's `get_pos_emb_on_this_cp_rank`, the same chunks (r and 2·CP-1-r of
    2·CP along `seq_dim`), its index made on the embedding's device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp, r = cp_group.size(), cp_group.rank()
    idx = torch.tensor([r, 2 * cp - r - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _moe_router_without_te() -> None:
    """megatron-core 0.16's MoE router gemm tests `te_general_gemm is not None`, a name it
    only defines when Transformer Engine imports: without TE every MoE forward raised
    NameError. Defined as None, the router takes its own torch matmul path (CPU and GPU)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mla_without_te() -> None:
    """Without Transformer Engine installed, megatron-core 0.16's
    `extensions/transformer_engine.py` still imports (its TE names stand on a mock), so
    `multi_latent_attention.HAVE_TE` reads True and MLA's `isinstance(linear_proj, TELinear)`
    raises on the mock. HAVE_TE set False where TE is not installed (CPU or GPU) is what
    the module would say had the import failed."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward on the gathered [.., kv_lora_rank + rope] latent; backward sums the
    RoPE key's columns over the TP group (each rank's share counts only its own heads)."""

    @staticmethod
    def forward(ctx, kv_combined, rope: int, group):
        ctx.rope, ctx.group = rope, group
        return kv_combined.view_as(kv_combined)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        rope = grad[..., -ctx.rope:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope:] = rope
        return grad, None, None


def _mla_rope_key_grads() -> None:
    """megatron-core 0.16.1's multi-latent attention on the local spec (its down projections
    column-parallel, `gather_output=False`) gathers the latent over TP, whose backward only
    takes each rank's columns back. The compressed KV's gradient is whole there (the
    column-parallel up projection after it reduced it), but the RoPE key (`k_pos_emb`, split
    off the same gathered tensor and shared by every head) gets from each rank only its own
    heads' share: at TP > 1 the KV down projection, and everything before it, trained on a
    partial gradient (Megatron-LM issue #1699; measured: a tiny DeepSeek-V3's gradients 1.2%
    off TP1's at TP2 + SP). Summing those columns over TP in backward is the gradient of the
    shared key. TE's spec (a duplicated down projection) does not take this path."""
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "_megarl_rope_key_grads", False):
        return
    gather, qkv = mla.gather_from_tensor_model_parallel_region, \
        mla.MLASelfAttention.get_query_key_value_tensors
    local = threading.local()

    def gather_latent(x, *args, **kwargs):
        out = gather(x, *args, **kwargs)
        frame = getattr(local, "frame", None)
        if frame is None:
            return out
        self, calls = frame
        c = self.config
        frame[1] = calls + 1
        # the calls are the query's (when it has a LoRA rank) and then the KV's
        kv_call = 1 if c.q_lora_rank is not None else 0
        if calls == kv_call and out.size(-1) == c.kv_lora_rank + c.qk_pos_emb_head_dim:
            out = _SumRopeKeyGrad.apply(out, c.qk_pos_emb_head_dim, self.tp_group)
        return out

    def get_query_key_value_tensors(self, *args, **kwargs):
        outer = getattr(local, "frame", None)
        local.frame = [self, 0]
        try:
            return qkv(self, *args, **kwargs)
        finally:
            local.frame = outer

    mla.gather_from_tensor_model_parallel_region = gather_latent
    mla.MLASelfAttention.get_query_key_value_tensors = get_query_key_value_tensors
    mla._megarl_rope_key_grads = True


def apply() -> None:
    """Install the CPU accommodations (idempotent; no-op with CUDA, except the MoE router's
    missing name and MLA's HAVE_TE, which any process without Transformer Engine needs, and
    MLA's RoPE-key gradient under TP, a correction wherever the local spec runs)."""
    global _applied
    _moe_router_without_te()
    _mla_without_te()
    _mla_rope_key_grads()
    if _applied or cuda_available():
        return
    import megatron.core
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as optimizer_module
    from megatron.core.pipeline_parallel import schedules

    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(TARGET_MEGATRON_CORE):
        logger.warning("CPU patches target megatron-core %s.x, found %s",
                       TARGET_MEGATRON_CORE, version)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    for module in (schedules, optimizer_module, clip_grads, distrib_optimizer, grad_scaler,
                   core_utils):
        module.torch = _CpuTorchShim()
    LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(
        LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    yarn.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    _applied = True
    logger.debug("megatron-core CPU patches applied (megatron-core %s)", version)


def cpu_rng_tracker() -> None:
    """Megatron's model-parallel RNG tracker with its named states on a CPU process, where
    `model_parallel_cuda_manual_seed` cannot run (it reads the CUDA generator). The states are
    placeholders: `apply()` made getting and setting a CUDA RNG state no-ops, so `fork()`
    (which sequence parallelism and the MoE experts enter) only checks the name and keeps
    the CPU generator, the one CPU dropout draws from, as it is. No-op with CUDA."""
    if cuda_available():
        return
    from megatron.core.tensor_parallel import random as tp_random

    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    for name in (tp_random._DATA_PARALLEL_RNG_TRACKER_NAME,
                 tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                 tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME):
        tracker.states_[name] = None
    tracker._is_initialized = True


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
        return name  # a conversion (`t.type(dtype)`), or a real CUDA tensor
    return "torch.cuda." + name[len("torch."):]


@contextlib.contextmanager
def cuda_tensor_types():
    """While Megatron's optimizer runs on the CPU, `tensor.type()` names the CUDA type of the
    same dtype, which is what its type checks accept (and what decides that bf16 params get
    fp32 main copies). The swap is process-wide for the duration: the optimizer runs on the
    rank's main thread, and nothing else in megarl asks for `Tensor.type()` names. No-op with
    CUDA."""
    if cuda_available():
        yield
        return
    saved = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = saved


@contextlib.contextmanager
def flex_backward_on_cpu():
    """torch 2.13's `flex_attention` refuses up front to run on CPU tensors that need a
    gradient (its fused backward is GPU-only), although its eager reference implementation,
    the one a CPU call runs, has a backward that autograd runs exactly. While this is open
    the refusal is lifted, so `attention_backend: flex` trains on the CPU (tests compare it
    with the per-length path there). No-op with CUDA."""
    if cuda_available():
        yield
        return
    from torch.nn.attention import flex_attention as fa

    saved = fa._validate_device
    fa._validate_device = lambda query, key, value: None
    try:
        yield
    finally:
        fa._validate_device = saved
