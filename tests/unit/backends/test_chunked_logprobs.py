"""The token-chunked log-prob + entropy path (verl's `entropy_from_logits_with_chunking`)
equals the plain one: values and logit gradients, fp32 within 1e-5, on a non-contiguous
[b, S-1, V] slice with a padded vocabulary tail, at a temperature, with chunks that do not
divide the token count; in bf16 its gradient keeps the logits' dtype; and under TP=2
(vocab-parallel, two gloo ranks, one rank's slice all padding) both paths equal the exact
log-softmax over the whole vocabulary, gradients included (the plain path's entropy gradient
under TP left out the other ranks' share until this test)."""
import json
import socket
import subprocess
import sys

import pytest
import torch

from megarl.backends.megatron.logprobs import chunked_vocab_parallel_logprobs, \
    vocab_parallel_logprobs


def _run(fn, logits, targets, vocab, temp, entropy, **kw):
    leaf = logits.detach().clone().requires_grad_()
    lp, ent = fn(leaf[:, :-1], targets, vocab, temp, entropy, **kw)
    g = torch.Generator().manual_seed(7)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    if entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if entropy else None), leaf.grad


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("chunk", [4, 1000])
def test_chunked_equals_plain_fp32(entropy, chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 40, generator=g) * 4  # vocab padded 33 -> 40
    targets = torch.randint(0, 33, (3, 8), generator=g)
    ref = _run(vocab_parallel_logprobs, logits, targets, 33, 0.7, entropy)
    got = _run(chunked_vocab_parallel_logprobs, logits, targets, 33, 0.7, entropy,
               chunk_size=chunk)
    assert torch.allclose(got[0], ref[0], atol=1e-5, rtol=0)
    if entropy:
        assert torch.allclose(got[1], ref[1], atol=1e-5, rtol=0)
    assert got[2].dtype == torch.float32
    assert torch.allclose(got[2], ref[2], atol=1e-5, rtol=0)
    assert got[2][:, -1].abs().max() == 0 and got[2][..., 33:].abs().max() == 0


def test_chunked_bf16_keeps_dtype_and_matches():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 17, 64, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 64, (2, 16), generator=g)
    ref = _run(vocab_parallel_logprobs, logits, targets, 64, 1.0, True)
    got = _run(chunked_vocab_parallel_logprobs, logits, targets, 64, 1.0, True, chunk_size=5)
    assert got[2].dtype == torch.bfloat16 and got[0].dtype == torch.float32
    assert torch.allclose(got[0], ref[0], atol=1e-5, rtol=0)
    assert torch.allclose(got[1], ref[1], atol=1e-5, rtol=0)
    assert torch.allclose(got[2].float(), ref[2].float(), atol=1e-2, rtol=0)


_PROGRAM = """
import json, sys, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from megarl.backends.megatron.logprobs import chunked_vocab_parallel_logprobs, \\
    vocab_parallel_logprobs
from megarl.backends.megatron.parallel import rank_program
port, rank = sys.argv[1], int(sys.argv[2])
with rank_program():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=2)
    ps.initialize_model_parallel(2, 1)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 7, 48, generator=g) * 4
    targets = torch.randint(0, 21, (2, 6), generator=g)
    out = {}
    # vocab 21 of 48: rank 1's slice [24, 48) is all padding
    for vocab in (40, 21):
        mine = full[..., rank * 24:(rank + 1) * 24]
        res = []
        for fn, kw in ((vocab_parallel_logprobs, {}),
                       (chunked_vocab_parallel_logprobs, {"chunk_size": 5})):
            leaf = mine.clone().requires_grad_()
            lp, ent = fn(leaf[:, :-1], targets, vocab, 0.9, True, **kw)
            (lp * torch.arange(6.0) + ent * 0.3).sum().backward()
            res.append((lp, ent, leaf.grad))
        # the exact values: softmax over the whole real vocabulary on one rank
        leaf = full.clone().requires_grad_()
        logq = torch.log_softmax(leaf[:, :-1, :vocab] / 0.9, -1)
        lp = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logq.exp() * logq).sum(-1)
        (lp * torch.arange(6.0) + ent * 0.3).sum().backward()
        exact = (lp, ent, leaf.grad[..., rank * 24:(rank + 1) * 24])
        out[str(vocab)] = [[float((a - b).abs().max()) for a, b in zip(r, exact)] for r in res]
    if rank == 0:
        print(json.dumps(out))
"""


def test_chunked_equals_plain_under_tensor_parallel():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _PROGRAM, str(port), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    errs = json.loads(outs[0][0].strip().splitlines()[-1])
    for vocab, per_path in errs.items():
        for path, (lp, ent, grad) in zip(("plain", "chunked"), per_path):
            assert max(lp, ent, grad) <= 1e-5, (vocab, path, lp, ent, grad)
