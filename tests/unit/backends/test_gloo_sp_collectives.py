"""Two gloo TP ranks (one pair of processes, shared by the checks to save their start-up):

The collectives of Megatron's sequence parallelism are exact over gloo (CPU runs).

Sequence parallelism replaces each TP all-reduce with a reduce-scatter (and all-gathers the
sequence before each TP linear). Two gloo ranks run Megatron's own mappings and the module
global its linears' backward calls (`layers.dist_reduce_scatter_func`, asynchronously): every
result equals, bit for bit, the slice of an all-reduce, the sums TP without SP makes, in
fp32 and bf16, on a sequence length that is a multiple of TP only after the worker pads it.

Vocab-parallel log-probs and entropy, the plain and the token-chunked path, equal the exact
log-softmax over the whole vocabulary, their logit gradients included, also where one rank's
slice is all padding (the plain path's entropy gradient under TP left out the other ranks'
share until 2026-11-29)."""
import json
import socket
import subprocess
import sys

import pytest

_PROGRAM = """
import json, sys, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import layers, mappings
from megarl.backends.megatron import _patches
from megarl.backends.megatron.logprobs import chunked_vocab_parallel_logprobs, \\
    vocab_parallel_logprobs
from megarl.backends.megatron.parallel import rank_program
port, rank = sys.argv[1], int(sys.argv[2])
with rank_program():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=2)
    ps.initialize_model_parallel(2, 1)
    _patches.apply()
    group = ps.get_tensor_model_parallel_group()
    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own partial sums
        x = (torch.randn(18, 3, 8, generator=g) * 1e3).to(dtype)  # [s, b, h], s = 17 + 1 pad
        full = x.clone()
        dist.all_reduce(full, group=group)
        mine = full[rank * 9:(rank + 1) * 9]
        name = str(dtype)[6:]
        got = mappings.reduce_scatter_to_sequence_parallel_region(x, group=group)
        checks[name + ":reduce_scatter"] = torch.equal(got, mine)
        out = torch.empty_like(mine)
        layers.dist_reduce_scatter_func(out, x, group=group, async_op=True).wait()
        checks[name + ":linear_backward"] = torch.equal(out, mine)
        gathered = mappings.gather_from_sequence_parallel_region(mine, group=group)
        checks[name + ":all_gather"] = torch.equal(gathered, full)
        # the all-gather's backward is the reduce-scatter of the incoming gradient
        leaf = mine.clone().requires_grad_()
        mappings.gather_from_sequence_parallel_region(leaf, group=group).backward(x)
        checks[name + ":gather_backward"] = torch.equal(leaf.grad, mine)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 7, 48, generator=g) * 4
    targets = torch.randint(0, 21, (2, 6), generator=g)
    logprobs = {}
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
        logprobs[str(vocab)] = [[float((a - b).abs().max()) for a, b in zip(r, exact)]
                                for r in res]
    if rank == 0:
        print(json.dumps({"collectives": checks, "logprobs": logprobs}))
"""


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _PROGRAM, str(port), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def test_sequence_parallel_collectives_are_exact_over_gloo(two_ranks):
    checks = two_ranks["collectives"]
    assert len(checks) == 8 and all(checks.values()), checks


def test_vocab_parallel_logprobs_are_exact_under_tensor_parallel(two_ranks):
    for vocab, per_path in two_ranks["logprobs"].items():
        for path, (lp, ent, grad) in zip(("plain", "chunked"), per_path):
            assert max(lp, ent, grad) <= 1e-5, (vocab, path, lp, ent, grad)
