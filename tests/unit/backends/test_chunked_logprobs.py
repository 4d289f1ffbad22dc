"""The token-chunked log-prob + entropy path (verl's `entropy_from_logits_with_chunking`)
equals the plain one: values and logit gradients, fp32 within 1e-5, on a non-contiguous
[b, S-1, V] slice with a padded vocabulary tail, at a temperature, with chunks that do not
divide the token count; in bf16 its gradient keeps the logits' dtype; . Under TP=2 both
paths are checked against the exact log-softmax in test_gloo_sp_collectives.py, whose two gloo
ranks they share."""
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
