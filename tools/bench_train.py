"""Train-step throughput: the Megatron worker against plain transformers + torch.optim.

    python tools/bench_train.py                      # tiny Qwen2, TP=1 PP=1, one process
    python tools/bench_train.py --tp 2               # relaunches itself under torchrun
    python tools/bench_train.py --pp 2 --model DIR   # an existing HF model directory
    python tools/bench_train.py --shape qwen2.5-1.5b --no-baseline   # a real shape, random init
    python tools/bench_train.py --token-budget 4096  # packed micro-batches beside padded ones

Both sides train the same model (same HF weights) on the same fixed batch with the same step:
masked token-mean NLL at temperature 1, the same micro-batching (gradients accumulated over
micro-batches, one AdamW step per batch), the same lr, grad clip 1.0. The Megatron side is
`MegatronWorker.train_step` on every TP×PP rank, built from the run config's actor section
(`--override` sets any of its keys); the baseline is `AutoModelForCausalLM` +
`torch.optim.AdamW` on rank 0 while the other ranks wait on a barrier. The sides alternate step
by step, so load from other work on the machine hits both alike. As a sanity check the
first-step loss and gradient norm of the two sides must agree (same weights, same batch); the
loss after the last step is printed too.

A real shape (`--config-json PATH`, or `--shape NAME` for configs/models/NAME.json) is built
from its config.json alone: Megatron initialises the weights at random in memory, so no
multi-GB checkpoint is written and no tokenizer is needed (the batch is random token ids). Its
baseline row is left out (transformers would start from other weights).

`--token-budget N` adds packed micro-batches (at most N real tokens each, packed into one
row: `packing.TokenBudget`, the trainer's `use_dynamic_bsz` path) as a row beside the padded
one (`--packed-only`: alone); the layouts take turns step by step on the one model.

Throughput is reported twice. On real tokens (the attention-mask sum: what a run learns from)
and on executed token slots (every position the step computed: padded rows at their full
width and filler rows, or packed rows with their tail; the worker's own `padding_frac`), each
with its FLOPs per token at the vocabulary the model has (printed). The step time is split
into forward+backward and the optimizer step (CUDA events on a GPU; on a CPU the wall clock,
with a barrier on each side of the optimizer step).

Threads: every process runs `torch.set_num_threads(--threads)` (default: the CPU count divided
by the number of ranks), so both sides run at the same `torch.get_num_threads()`. With TP×PP > 1
the Megatron side therefore uses TP×PP times the cores the baseline does; the report says so.

Deliberately simplified: one fixed batch of random tokens (no data loading), float32 on both
sides unless --dtype says otherwise, no checkpointing or weight export. When --batch is not a
multiple of --micro-batch the worker fills its last micro-batch with zero rows (pipeline stages
exchange fixed shapes) and the baseline does not; with --token-budget the baseline still runs
padded micro-batches of --micro-batch rows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.utils.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "models"  # --shape NAME: SHAPES/NAME.json (dots and dashes: _)
MEGATRON_SECTION = "actor_rollout_ref.actor.megatron"  # where a relative --override lands
TOP_SECTIONS = ("actor_rollout_ref.", "trainer.", "algorithm.", "data.", "critic.")


def shape_path(name: str) -> Path:
    """configs/models/<name>.json for --shape (qwen2.5-1.5b -> qwen2_5_1_5b.json)."""
    path = SHAPES / (name.replace(".", "_").replace("-", "_") + ".json")
    if not path.is_file():
        known = sorted(f.stem for f in SHAPES.glob("*.json"))
        raise SystemExit(f"--shape {name}: no {path.relative_to(ROOT)} (have: {', '.join(known)})")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: make a tiny one in a temp dir)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config-json", help="an HF config.json: that shape at random init, no "
                     "checkpoint written (implies --no-baseline)")
    src.add_argument("--shape", help="a config.json kept in configs/models/ by name, e.g. "
                     "qwen2.5-1.5b (as --config-json)")
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="intermediate size (default 3×hidden)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=None,
                   help="packed micro-batches of at most this many real tokens on the Megatron "
                        "side (packing.TokenBudget, as use_dynamic_bsz does) instead of "
                        "--micro-batch rows padded to --seq")
    p.add_argument("--packed-only", action="store_true",
                   help="with --token-budget: the packed layout alone, not beside the padded one")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: CPU count // (tp×pp))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="Megatron params_dtype (bf16: fp32 main grads); the baseline then runs "
                        "under torch.autocast to the same dtype")
    p.add_argument("--optimizer", choices=("megatron", "torch"), default="megatron",
                   help="the Megatron side's optimizer (megatron.optimizer): Megatron's DDP + "
                        "optimizer, or the plain-AdamW fallback")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a run-config key for the Megatron side, relative to "
                        f"{MEGATRON_SECTION} (e.g. override_transformer_config."
                        "recompute_granularity=full) or a full dotted path; repeatable")
    p.add_argument("--no-baseline", action="store_true",
                   help="Megatron side only (a model too large to hold twice)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak dense FLOP/s in TFLOP/s for --dtype, to print MFU "
                        "(H100/H200 SXM bf16: 989)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="profile one more step (torch.profiler) and write its top kernels to "
                        "DIR/top_kernels.txt")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    # under torchrun the ranks get the temp directory the launcher made as --model as well
    if (a.shape or a.config_json) and a.model and "TORCHELASTIC_RUN_ID" not in os.environ:
        p.error("--model and --config-json/--shape: give one")
    if a.shape:
        a.config_json = str(shape_path(a.shape))
    if a.config_json:
        a.no_baseline = True
    for o in a.override:
        if "=" not in o:
            p.error(f"--override {o!r}: expected KEY=VALUE")
    if a.token_budget is not None and a.token_budget < 1:
        p.error(f"--token-budget {a.token_budget}: must be at least 1")
    if a.packed_only and not a.token_budget:
        p.error("--packed-only needs --token-budget")
    return a


def worker_overrides(a) -> list[str]:
    """The run-config overrides the Megatron side is built from: the bench's own settings,
    then --override (so a user's key wins), relative keys under MEGATRON_SECTION."""
    m = MEGATRON_SECTION
    base = [f"actor_rollout_ref.model.path={a.model}", f"{m}.tensor_model_parallel_size={a.tp}",
            f"{m}.pipeline_model_parallel_size={a.pp}", f"{m}.params_dtype={a.dtype}",
            f"{m}.optimizer={a.optimizer}", f"{m}.seed={a.seed}",
            f"actor_rollout_ref.actor.optim.lr={a.lr}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",  # the baseline's AdamW
            "actor_rollout_ref.actor.optim.clip_grad=1.0"]
    user = [o if o.startswith(TOP_SECTIONS) else f"{m}.{o}" for o in a.override]
    return base + user


def load_run_config(a, model: str | None = None):
    """The run config the Megatron side is built from; a bad --override fails here, naming
    its key (ConfigError), before any model is made or process started."""
    from megarl.config.loader import load_config

    a = argparse.Namespace(**{**vars(a), "model": model or a.model or "unset"})
    return load_config(None, worker_overrides(a),
                       cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def build_worker(a):
    """The actor's MegatronWorker as a run builds it (`megatron_spec`), with HF weights from
    --model or, for a config.json alone, Megatron's random init."""
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.cluster.spec import megatron_spec

    cfg = load_run_config(a)
    return MegatronWorker.from_spec(megatron_spec(cfg, "actor").model,
                                     load_hf=not a.config_json)


def make_batch(a, hf_config: dict) -> dict:
    """Right-padded random token ids, lengths uniform in [seq/2, seq]: padding is work for both
    sides but is not counted in tokens/s. Real tokens never use the pad id: HF embeddings are
    built with `padding_idx` (no gradient for that row), which Megatron's are not, so a pad id
    inside the text would make the two sides' embedding gradients differ."""
    g = torch.Generator().manual_seed(a.seed)
    pad = hf_config.get("pad_token_id")
    pad = 0 if pad is None else pad
    ids = torch.randint(0, hf_config["vocab_size"] - 1, (a.batch, a.seq), generator=g)
    ids = ids + (ids >= pad).long()  # skip the pad id
    lens = torch.randint(a.seq // 2, a.seq + 1, (a.batch,), generator=g)
    mask = (torch.arange(a.seq).unsqueeze(0) < lens.unsqueeze(1)).long()
    return {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}


def loss_mask(mask: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a prediction: real tokens except position 0."""
    m = mask.clone().float()
    m[:, 0] = 0
    return m


def megatron_loss_fn(total_tokens: float):
    def loss_fn(logprobs, entropy, mb):
        # This micro-batch's share of the whole batch's token-mean NLL.
        return -(logprobs * loss_mask(mb["attention_mask"])).sum() / total_tokens, {}
    return loss_fn


class HFBaseline:
    """transformers + torch.optim.AdamW, the step a user would write by hand."""

    def __init__(self, model_dir: str, lr: float, device: torch.device,
                 dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.device = device
        # fp32 weights and optimizer, the matmuls in `dtype`: mixed precision as users write it
        self.autocast = dtype != "float32"
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def train_step(self, batch: dict, micro_batch_size: int) -> tuple[float, float]:
        """One AdamW step; returns (loss, grad norm before clipping)."""
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        total = loss_mask(mask).sum()
        self.opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i in range(0, ids.shape[0], micro_batch_size):
            mb_ids, mb_mask = ids[i:i + micro_batch_size], mask[i:i + micro_batch_size]
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
                logits = self.model(input_ids=mb_ids, attention_mask=mb_mask).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            logp = logp.gather(-1, mb_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp * loss_mask(mb_mask)[:, 1:]).sum() / total
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss_sum, float(norm)


class OptimizerClock:
    """Times the worker's optimizer step from the outside (the step the trainer runs,
    unchanged): CUDA events around it on a GPU, read once the step has synchronised; on a CPU
    the wall clock between two barriers, so every rank's step is inside it."""

    def __init__(self, optimizer, on_gpu: bool):
        self.inner, self.on_gpu = optimizer.step, on_gpu
        self.events: list = []
        self.cpu_s: list[float] = []
        optimizer.step = self  # an instance attribute: the worker calls it in place of step

    def __call__(self, *args, **kw):
        if self.on_gpu:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = self.inner(*args, **kw)
            end.record()
            self.events.append((start, end))
            return out
        dist.barrier()
        t0 = time.perf_counter()
        out = self.inner(*args, **kw)
        dist.barrier()
        self.cpu_s.append(time.perf_counter() - t0)
        return out

    def last_s(self) -> float:
        """The last step's optimizer seconds (after the device has synchronised)."""
        if self.on_gpu:
            start, end = self.events[-1]
            return start.elapsed_time(end) / 1e3
        return self.cpu_s[-1]


def layouts(a) -> list[tuple[str, object]]:
    """The Megatron side's micro-batchings: padded rows of --micro-batch (unless
    --packed-only), and beside it packed micro-batches of --token-budget tokens."""
    from megarl.backends.megatron.packing import TokenBudget

    out = [] if a.packed_only else [("padded", a.micro_batch)]
    return out + ([("packed", TokenBudget(a.token_budget))] if a.token_budget else [])


def run(a) -> None:
    """One rank's benchmark (torch.distributed env already set); rank 0 prints the report.

    The sides alternate step by step, so a change in machine load hits all alike: every rank
    runs the Megatron step in each layout (padded, packed), then rank 0 runs the baseline
    step while the others wait on a barrier. The layouts train one model in turn, so from
    the second step on each starts from weights the other has updated.
    """
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.utils.tiny_model import read_hf_config

    torch.set_num_threads(a.threads)
    worker = build_worker(a)
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    base = HFBaseline(a.model, a.lr, device, a.dtype) \
        if rank == 0 and not a.no_baseline else None
    hf_config = read_hf_config(a.model)
    batch = make_batch(a, hf_config)
    loss_fn = megatron_loss_fn(float(loss_mask(batch["attention_mask"]).sum()))
    clock = OptimizerClock(worker.optimizer, on_gpu)

    sides = {name: {"micro": micro, "res": [], "times": [], "opt": [], "stats": {}}
             for name, micro in layouts(a)}
    b_res, b_times = [], []  # baseline: per-step (loss, grad norm), step seconds
    for i in range(a.warmup + a.steps):
        for side in sides.values():
            dist.barrier()
            t0 = time.perf_counter()
            side["stats"] = stats = worker.train_step(batch, loss_fn,
                                                      micro_batch_size=side["micro"])
            side["res"].append((stats["loss"], stats["grad_norm"]))
            sync()
            dist.barrier()
            if i >= a.warmup:
                side["times"].append(time.perf_counter() - t0)
                side["opt"].append(clock.last_s())
        t1 = time.perf_counter()
        if base is not None:
            b_res.append(base.train_step(batch, a.micro_batch))
            sync()
        if i >= a.warmup:
            b_times.append(time.perf_counter() - t1)
    if a.profile:
        profile_step(a, worker, batch, loss_fn, list(sides.values())[-1]["micro"], on_gpu, rank)
    if rank == 0:
        for name, side in sides.items():
            side["acc"] = accounting(hf_config, batch["attention_mask"], side["stats"],
                                     name == "packed")
        res = report(a, world, sides, b_res, b_times)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    dist.barrier()
    destroy_distributed()


def profile_step(a, worker, batch, loss_fn, micro, on_gpu: bool, rank: int) -> None:
    """One more train step under torch.profiler; rank 0 writes the top kernels (by their own
    device time on a GPU, CPU time otherwise) as a table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    dist.barrier()
    with profile(activities=acts) as prof:
        worker.train_step(batch, loss_fn, micro_batch_size=micro)
        if on_gpu:
            torch.cuda.synchronize()
    if rank == 0:
        os.makedirs(a.profile, exist_ok=True)
        key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=30)
        path = os.path.join(a.profile, "top_kernels.txt")
        with open(path, "w") as fh:
            fh.write(f"one Megatron train step, sorted by {key}\n")
            fh.write(table + "\n")


def attention_len(lengths: list[int]) -> float:
    """The sequence length attention runs at, per token: each token attends over its own
    sequence, so the token-weighted mean of the lengths, sum(n²) / sum(n)."""
    return sum(n * n for n in lengths) / max(1, sum(lengths))


def accounting(cfg: dict, mask: torch.Tensor, stats: dict, packed: bool) -> dict:
    """What a step computed: its real tokens and their FLOPs each, and its executed token
    slots (from the worker's own padding fraction) and theirs. A padded slot runs attention
    over its row's whole width; a packed one over its own sequence (a document mask)."""
    lengths = [int(n) for n in mask.sum(1)]
    tokens = sum(lengths)
    slots = round(tokens / (1.0 - stats["padding_frac"]))
    fpt = flops_per_token(cfg, attention_len(lengths))
    slot_fpt = fpt if packed else flops_per_token(cfg, mask.shape[1])
    return {"tokens": tokens, "slots": slots, "flops_per_token": fpt,
            "flops_per_slot": slot_fpt, "vocab": cfg["vocab_size"],
            "micro_batches": int(stats["micro_batches"]), "packed": packed}


def flops_per_token(cfg: dict, seq: float) -> float:
    """Model FLOPs of one trained token (forward and backward, 3x the forward): 6 per
    parameter of a matrix multiply (every layer's attention and MLP weights and the output
    layer; not the embedding lookup or the norms), plus attention's scores and weighted sum,
    2·2·seq·(heads·head_dim) per layer forward, so 12·L·seq·heads·head_dim (not halved for the
    causal mask, as in Megatron's and PaLM's MFU)."""
    d, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or \
        cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // heads
    ffn = cfg["intermediate_size"]
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * ffn  # q,kv,o,mlp
    return 6.0 * (L * per_layer + V * d) + 12.0 * L * seq * heads * hd


def report(a, world: int, sides: dict, b_res, b_times) -> dict:
    """Print the table and the FLOP lines; return the figures, by layout. `sides`: each
    layout's per-step (loss, grad norm) `res` (warmup steps included), timed step and
    optimizer seconds, and `acc`ounting; b_res/b_times: the baseline's."""
    first = next(iter(sides.values()))["acc"]
    tokens = first["tokens"]
    said = {"padded": f"micro-batch {a.micro_batch} rows padded to {a.seq}",
            "packed": f"packed by token budget {a.token_budget}"}
    print(f"model {a.model}  batch {a.batch}x{a.seq} ({tokens} real tokens)  "
          f"{'; '.join(said[n] for n in sides)}  {a.dtype}  steps {a.steps} (+{a.warmup} "
          f"warmup)  threads/process {torch.get_num_threads()}"
          + (f"  overrides {' '.join(a.override)}" if a.override else ""))
    # min step time alongside the mean: on a shared machine the min is the less noisy of the two.
    print(f"{'side':<32}{'step s':>8}{'min s':>8}{'optim s':>8}{'tokens/s':>10}{'slots':>8}"
          f"{'loss@1':>10}{'gnorm@1':>10}{'loss@last':>11}")
    out = {"vocab": first["vocab"], "tokens": tokens, "dtype": a.dtype, "world": world}
    for name, side in sides.items():
        acc, times = side["acc"], side["times"]
        step_s, opt_s = sum(times) / len(times), sum(side["opt"]) / len(side["opt"])
        res = side["res"]
        label = f"megatron TP{a.tp} PP{a.pp} {name} ({acc['micro_batches']} mb)"
        print(f"{label:<32}{step_s:>8.3f}{min(times):>8.3f}{opt_s:>8.3f}{tokens / step_s:>10.0f}"
              f"{acc['slots']:>8}{res[0][0]:>10.5f}{res[0][1]:>10.4f}{res[-1][0]:>11.5f}")
        out[name] = {"step_s": step_s, "min_step_s": min(times), "optimizer_s": opt_s,
                     "tokens_per_s": tokens / step_s, "loss_first": res[0][0],
                     "grad_norm_first": res[0][1], "loss_last": res[-1][0], **acc}
    if b_res:  # not with --no-baseline
        step_s = sum(b_times) / len(b_times)
        print(f"{'hf+torch.optim (1 proc)':<32}{step_s:>8.3f}{min(b_times):>8.3f}{'':>8}"
              f"{tokens / step_s:>10.0f}{'':>8}{b_res[0][0]:>10.5f}{b_res[0][1]:>10.4f}"
              f"{b_res[-1][0]:>11.5f}")
        out["baseline"] = {"step_s": step_s, "tokens_per_s": tokens / step_s}
    timer = "CUDA events" if torch.cuda.is_available() else "wall clock between barriers"
    for name, side in sides.items():
        fig, acc = out[name], side["acc"]
        print(f"megatron {name}: forward+backward {fig['step_s'] - fig['optimizer_s']:.3f} s, "
              f"optimizer {fig['optimizer_s']:.3f} s ({timer})")
        # Twice: on the real tokens (what a run learns from) and on every position the step
        # computes (what the device did); padding makes the first smaller.
        for key, what, n, per in (("real", "real tokens", tokens, acc["flops_per_token"]),
                                  ("slots", "executed slots", acc["slots"],
                                   acc["flops_per_slot"])):
            rate = n / fig["step_s"]
            tflops = rate * per / world / 1e12
            mfu = 100 * tflops / a.peak_tflops if a.peak_tflops else None
            fig[f"tflops_{key}"], fig[f"mfu_{key}"] = tflops, mfu
            print(f"  on {what} ({rate:.0f}/s): {per / 1e9:.4g} GFLOP each at vocabulary "
                  f"{acc['vocab']}, {tflops:.3f} TFLOP/s per device"
                  + (f"  MFU {mfu:.1f}%" if mfu is not None else "  (MFU: --peak-tflops)"))
    if not b_res:
        return out
    b_tps = out["baseline"]["tokens_per_s"]
    for name in sides:
        print(f"ratio megatron {name} ({a.optimizer} optimizer)/baseline tokens/s: "
              f"{out[name]['tokens_per_s'] / b_tps:.2f}"
              + (f"  (megatron uses {world}x the baseline's cores)" if world > 1 else ""))
    # Same weights and batch: the first step's loss and gradient norm must agree to float32
    # round-off, or bf16's (loss@last shows whether the updates agree as well). Only the
    # first layout starts from the baseline's weights.
    m0 = next(iter(sides.values()))["res"][0]
    tol = 1e-4 if a.dtype == "float32" else 2e-2
    ok = all(abs(m - b) <= tol * max(1.0, abs(b)) for m, b in zip(m0, b_res[0]))
    out["first_step_ok"] = ok
    print(f"first-step check (loss, grad norm): |diff| = {abs(m0[0] - b_res[0][0]):.1e}, "
          f"{abs(m0[1] - b_res[0][1]):.1e} -> {'OK' if ok else 'MISMATCH'}")
    return out


def launch(a, argv: list[str]) -> int:
    """Make the model directory if needed, then run in this process (1 rank) or under
    torchrun."""
    world = a.tp * a.pp
    tmp = None
    if a.model is None:
        tmp = tempfile.mkdtemp(prefix="bench_train-")
        if a.config_json:
            # the config alone: the worker reads the shape from it and initialises at random
            a.model = os.path.join(tmp, "shape")
            os.makedirs(a.model)
            shutil.copy(a.config_json, os.path.join(a.model, "config.json"))
        else:
            from megarl.utils.tiny_model import make_tiny_model

            # the model's vocabulary is --vocab whatever the tiny tokenizer reaches (it stops
            # at a few thousand tokens): the output layer is the largest matmul at a real
            # vocabulary
            a.model = str(make_tiny_model(
                os.path.join(tmp, f"tiny-{a.arch}"), a.arch, vocab_size=min(a.vocab, 4096),
                model_vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                num_heads=a.heads, num_kv_heads=a.kv_heads,
                intermediate_size=a.ffn or 3 * a.hidden, seed=a.seed))
        argv = [*argv, "--model", a.model]
    try:
        if world == 1:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            run(a)
            return 0
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(world), os.path.abspath(__file__), *argv]
        return subprocess.run(cmd, env=env).returncode
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.threads is None:
        a.threads = max(1, (os.cpu_count() or 1) // (a.tp * a.pp))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank started by launch() under torchrun
        run(a)
        return 0
    from megarl.utils.errors import ConfigError

    try:
        load_run_config(a)
    except ConfigError as err:
        print(f"bench_train.py: {err}", file=sys.stderr)
        return 2
    return launch(a, argv)


if __name__ == "__main__":
    sys.exit(main())
