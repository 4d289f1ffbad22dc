"""Tokens/s of the embedded rollout engine (and, with `--stock`, the stock SGLang server on
this CPU) against plain transformers `generate`.

All run the same model, prompts, batch and per-row lengths, greedy (so the tokens can be
checked equal). Two workloads:

- `uniform`: every row generates exactly `--new-tokens` (static batching's best case);
- `longtail`: row budgets drawn from [new_tokens/8, new_tokens] (RL's long tail). `generate`
  has one budget for the whole batch, so it runs to the longest and its surplus tokens are
  cut off and not counted; the engine hands each row back when its budget is spent.

Tokens/s counts useful output tokens over wall time; "first back" is when the first complete
response is available (for `generate`, only when the whole batch ends).

    python tools/bench_rollout.py [--device cuda] [--layers 4 --hidden 256 --batch 32 ...]
    python tools/bench_rollout.py --stock    # + stock sglang.launch_server (CPU environment of
                                             #   tools/setup_sglang_env.sh), over HTTP
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.rollout.engine import EmbeddedEngine  # noqa: E402
from megarl.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from megarl.utils.tiny_model import make_tiny_model  # noqa: E402


def run_hf(model, prompts, budgets, device):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max(budgets), min_new_tokens=max(budgets),
                             eos_token_id=None, pad_token_id=0)
    sync(device)
    wall = time.perf_counter() - t0
    rows = [out[i, width:width + b].tolist() for i, b in enumerate(budgets)]
    return wall, wall, rows


def run_engine(engine, prompts, budgets, close=False):
    """`close`: an HTTP engine made for this run (its session belongs to this event loop)."""
    async def go():
        first = []

        async def one(p, b):
            sp = SamplingParams(max_new_tokens=b, temperature=0.0, ignore_eos=True)
            out = await engine.generate(GenerateRequest(list(p), sp, return_logprob=True))
            first.append(time.perf_counter())
            return out.output_ids

        t0 = time.perf_counter()
        rows = await asyncio.gather(*[one(p, b) for p, b in zip(prompts, budgets)])
        wall = time.perf_counter() - t0
        if close:
            await engine.close()
        return wall, min(first) - t0, rows

    return asyncio.run(go())


def start_stock(model_dir, args):
    """The stock server on this CPU, from its own environment (fp32 unless --dtype)."""
    from megarl.backends.sglang import cpu_env
    from megarl.backends.sglang.launcher import ServerArgs, find_free_port, launch_server

    problem = cpu_env.venv_status()
    if problem and not args.server_python:
        raise SystemExit(f"--stock: {problem}")
    ctx = args.prompt_len[1] + args.new_tokens + 8
    server = ServerArgs(str(model_dir), port=find_free_port(), device="cpu",
                        python=args.server_python or cpu_env.server_python(),
                        dtype=args.dtype or "float32", context_length=ctx,
                        max_running_requests=max(8, args.batch))
    return launch_server(server, timeout_s=600)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 on GPU; default: model's")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs; the best is reported")
    ap.add_argument("--model", default=None, help="an HF model dir instead of a tiny one")
    ap.add_argument("--stock", action="store_true",
                    help="also the stock SGLang server on this CPU (same prompts, over HTTP)")
    ap.add_argument("--server-python", default=None,
                    help="with --stock: the server's Python (default: megarl's lookup)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model or make_tiny_model(
        Path(tmp.name) / "model", hidden_size=args.hidden, num_layers=args.layers,
        num_heads=max(4, args.hidden // 64), num_kv_heads=2,
        intermediate_size=args.hidden * 4, vocab_size=args.vocab)
    engine = EmbeddedEngine(model_dir, device=args.device, dtype=args.dtype,
                            max_running_requests=max(64, args.batch))
    model = engine.model  # the same weights for both sides
    rng = random.Random(0)
    prompts = [[rng.randrange(10, engine.vocab_size) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.batch)]
    workloads = {
        "uniform": [args.new_tokens] * args.batch,
        "longtail": [rng.randint(max(1, args.new_tokens // 8), args.new_tokens)
                     for _ in range(args.batch)],
    }
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device={args.device} threads={torch.get_num_threads()} params={n_params / 1e6:.2f}M "
          f"layers={args.layers} hidden={args.hidden} batch={args.batch} "
          f"prompt_len={tuple(args.prompt_len)} new_tokens<={args.new_tokens}")
    stock = stock_engine = None
    if args.stock:
        from megarl.backends.sglang import SGLangEngine

        stock = start_stock(model_dir, args)
        stock_engine = lambda: SGLangEngine(stock.url)  # noqa: E731 - one per asyncio.run
    print(f"{'workload':9} {'tokens':>7} {'generate tok/s':>15} {'engine tok/s':>13} "
          f"{'ratio':>6} {'gen first back':>15} {'eng first back':>15} {'same tokens':>12}"
          + (f" {'stock tok/s':>12} {'ratio':>6} {'stock first back':>17} {'same':>6}"
             if stock else ""))
    run_hf(model, prompts[:2], [4, 4], args.device)  # warm-up
    run_engine(engine, prompts[:2], [4, 4])
    if stock:
        run_engine(stock_engine(), prompts[:2], [4, 4], close=True)
    try:
        for name, budgets in workloads.items():
            # Interleaved, best of `repeats`: a shared machine's load hits every side alike.
            hf_runs, eng_runs, stock_runs = [], [], []
            for _ in range(args.repeats):
                hf_runs.append(run_hf(model, prompts, budgets, args.device))
                eng_runs.append(run_engine(engine, prompts, budgets))
                if stock:
                    stock_runs.append(run_engine(stock_engine(), prompts, budgets, close=True))
            hf, eng = min(hf_runs, key=lambda r: r[0]), min(eng_runs, key=lambda r: r[0])
            tokens = sum(budgets)
            same = sum(a == b for a, b in zip(hf[2], eng[2]))
            line = (f"{name:9} {tokens:7d} {tokens / hf[0]:15.0f} {tokens / eng[0]:13.0f} "
                    f"{hf[0] / eng[0]:6.2f} {hf[1]:14.3f}s {eng[1]:14.3f}s "
                    f"{same:>7}/{len(budgets)}")
            if stock:
                st = min(stock_runs, key=lambda r: r[0])
                st_same = sum(a == b for a, b in zip(hf[2], st[2]))
                line += (f" {tokens / st[0]:12.0f} {hf[0] / st[0]:6.2f} {st[1]:16.3f}s "
                         f"{st_same:>3}/{len(budgets)}")
            print(line)
    finally:
        asyncio.run(engine.close())
        if stock:
            stock.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
