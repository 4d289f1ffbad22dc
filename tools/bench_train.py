"""Train-step throughput: the Megatron worker against plain transformers + torch.optim.

    python tools/bench_train.py                      # tiny Qwen2, TP=1 PP=1, one process
    python tools/bench_train.py --tp 2               # relaunches itself under torchrun
    python tools/bench_train.py --pp 2 --model DIR   # an existing HF model directory

Both sides train the same model (same HF weights) on the same fixed batch with the same step:
masked token-mean NLL at temperature 1, the same micro-batching (gradients accumulated over
micro-batches, one AdamW step per batch), the same lr, grad clip 1.0. The Megatron side is
`MegatronWorker.train_step` on every TP×PP rank; the baseline is `AutoModelForCausalLM` +
`torch.optim.AdamW` on rank 0 while the other ranks wait on a barrier. The sides alternate step
by step, so load from other work on the machine hits both alike. Tokens/s counts real tokens
(the attention-mask sum). As a sanity check the first-step loss and gradient norm of the two
sides must agree (same weights, same batch); the loss after the last step is printed too.

Threads: every process runs `torch.set_num_threads(--threads)` (default: the CPU count divided
by the number of ranks), so both sides run at the same `torch.get_num_threads()`. With TP×PP > 1
the Megatron side therefore uses TP×PP times the cores the baseline does; the report says so.

Deliberately simplified: one fixed batch of random tokens (no data loading), float32 on both
sides (on a GPU both run there, no mixed precision), no checkpointing or weight export. When
--batch is not a multiple of --micro-batch the worker fills its last micro-batch with zero rows
(pipeline stages exchange fixed shapes) and the baseline does not.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megarl.utils.launch import free_port


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: make a tiny one in a temp dir)")
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
    p.add_argument("--no-baseline", action="store_true",
                   help="Megatron side only (a model too large to hold twice)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak dense FLOP/s in TFLOP/s for --dtype, to print MFU "
                        "(H100/H200 SXM bf16: 989)")
    return p.parse_args(argv)


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


def run(a) -> None:
    """One rank's benchmark (torch.distributed env already set); rank 0 prints the report.

    The two sides alternate step by step, so a change in machine load hits both alike: every
    rank runs the Megatron step, then rank 0 runs the baseline step while the others wait on a
    barrier.
    """
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.utils.tiny_model import read_hf_config

    torch.set_num_threads(a.threads)
    worker = MegatronWorker(a.model, a.tp, a.pp, params_dtype=a.dtype,
                            optim=OptimConfig(lr=a.lr, clip_grad=1.0, impl=a.optimizer))
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    base = HFBaseline(a.model, a.lr, device, a.dtype) \
        if rank == 0 and not a.no_baseline else None
    hf_config = read_hf_config(a.model)
    batch = make_batch(a, hf_config)
    tokens = int(batch["attention_mask"].sum())
    loss_fn = megatron_loss_fn(float(loss_mask(batch["attention_mask"]).sum()))

    m_res, b_res, m_times, b_times = [], [], [], []  # results: (loss, grad norm) per step
    for i in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        stats = worker.train_step(batch, loss_fn, micro_batch_size=a.micro_batch)
        m_res.append((stats["loss"], stats["grad_norm"]))
        sync()
        dist.barrier()
        t1 = time.perf_counter()
        if base is not None:
            b_res.append(base.train_step(batch, a.micro_batch))
            sync()
        t2 = time.perf_counter()
        if i >= a.warmup:
            m_times.append(t1 - t0)
            b_times.append(t2 - t1)
    if rank == 0:
        seq = tokens / a.batch  # the mean real length: attention's share of the FLOPs
        # what the Megatron step computes: every position of its padded micro-batches (the
        # last one filled up with zero rows to the micro-batch size)
        slots = -(-a.batch // a.micro_batch) * a.micro_batch * a.seq
        report(a, world, tokens, m_res, m_times, b_res, b_times,
               flops_per_token(hf_config, seq), slots, flops_per_token(hf_config, a.seq),
               hf_config["vocab_size"])
    dist.barrier()
    destroy_distributed()


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


def report(a, world, tokens, m_res, m_times, b_res, b_times, fpt: float, slots: int,
           slot_fpt: float, vocab: int) -> None:
    """m_res/b_res: per-step (loss, grad norm), warmup steps included; `fpt`: model FLOPs
    per real token (attention at the mean real length); `slots`, `slot_fpt`: the token
    positions the Megatron step computes, padding included, and their FLOPs each."""
    m_step = sum(m_times) / len(m_times)
    m_tps = tokens / m_step
    print(f"model {a.model}  batch {a.batch}x{a.seq} ({tokens} real tokens)  "
          f"micro-batch {a.micro_batch}  steps {a.steps} (+{a.warmup} warmup)  "
          f"threads/process {torch.get_num_threads()}")
    # min step time alongside the mean: on a shared machine the min is the less noisy of the two.
    print(f"{'side':<24}{'step s':>8}{'min s':>8}{'tokens/s':>10}{'loss@1':>10}{'gnorm@1':>10}"
          f"{'loss@last':>11}")
    rows = [(f"megatron TP{a.tp} PP{a.pp} ({world} proc)", m_times, m_res)]
    if b_res:  # not with --no-baseline
        rows.append(("hf+torch.optim (1 proc)", b_times, b_res))
    for name, times, res in rows:
        step_s = sum(times) / len(times)
        tps = tokens / step_s
        print(f"{name:<24}{step_s:>8.3f}{min(times):>8.3f}{tps:>10.0f}{res[0][0]:>10.5f}"
              f"{res[0][1]:>10.4f}{res[-1][0]:>11.5f}")
    # Twice: on the real tokens (what a run learns from) and on every position the step
    # computes (what the device did); padding makes the first smaller.
    m_slots = slots / m_step
    for what, rate, per in (("real tokens", m_tps, fpt), ("executed slots", m_slots, slot_fpt)):
        tflops = rate * per / world / 1e12
        mfu = f"  MFU {100 * tflops / a.peak_tflops:.1f}%" if a.peak_tflops else ""
        print(f"megatron on {what} ({rate:.0f}/s): {per / 1e9:.2f} GFLOP each at vocabulary "
              f"{vocab}, {tflops:.2f} TFLOP/s per device{mfu}")
    if a.no_baseline:
        return
    b_tps = tokens / (sum(b_times) / len(b_times))
    print(f"ratio megatron ({a.optimizer} optimizer)/baseline tokens/s: {m_tps / b_tps:.2f}"
          + (f"  (megatron uses {world}x the baseline's cores)" if world > 1 else ""))
    # Same weights and batch: the first step's loss and gradient norm must agree to float32
    # round-off, or bf16's (loss@last shows whether the updates agree as well).
    tol = 1e-4 if a.dtype == "float32" else 2e-2
    ok = all(abs(m - b) <= tol * max(1.0, abs(b)) for m, b in zip(m_res[0], b_res[0]))
    print(f"first-step check (loss, grad norm): |diff| = {abs(m_res[0][0] - b_res[0][0]):.1e}, "
          f"{abs(m_res[0][1] - b_res[0][1]):.1e} -> {'OK' if ok else 'MISMATCH'}")


def launch(a, argv: list[str]) -> int:
    """Make the model if needed, then run in this process (1 rank) or under torchrun."""
    world = a.tp * a.pp
    tmp = None
    if a.model is None:
        from megarl.utils.tiny_model import make_tiny_model

        tmp = tempfile.mkdtemp(prefix="bench_train-")
        # the model's vocabulary is --vocab whatever the tiny tokenizer reaches (it stops at a
        # few thousand tokens): the output layer is the largest matmul at a real vocabulary
        a.model = str(make_tiny_model(
            os.path.join(tmp, f"tiny-{a.arch}"), a.arch, vocab_size=min(a.vocab, 4096),
            model_vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
            num_kv_heads=a.kv_heads, intermediate_size=a.ffn or 3 * a.hidden, seed=a.seed))
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
    return launch(a, argv)


if __name__ == "__main__":
    sys.exit(main())
