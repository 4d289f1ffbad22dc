"""The clipped value loss against hand-computed values, its gradient, and micro-batch shares."""
import torch

from megarl.algo.aggregate import global_denom
from megarl.algo.value_loss import make_critic_loss, value_loss

# row 0: t0 v 1.0 clipped to 0.7 (old 0.5 +- 0.2): (1-1.2)^2 = 0.04 < (0.7-1.2)^2 = 0.25 -> 0.25
#        t1 v 0.0 clipped to 0.3: (0-1)^2 = 1.0 > (0.3-1)^2 = 0.49 -> 1.0
#        t2 masked (v 2.0 would dominate)
# row 1: t0 v 0.6 inside [0.3, 0.7]: both branches 0
VP = torch.tensor([[1.0, 0.0, 2.0], [0.6, 5.0, 5.0]])
OLD = torch.full((2, 3), 0.5)
RET = torch.tensor([[1.2, 1.0, 0.0], [0.6, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_value_loss_by_hand():
    vp = VP.clone().requires_grad_(True)
    loss, st = value_loss(vp, OLD, RET, MASK, 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 1.25 / 3))       # token-mean
    torch.testing.assert_close(st["vf_clipfrac"], torch.tensor(1 / 3))
    loss.backward()
    # t0: the clipped branch is active and saturated -> no gradient; t1: 0.5 * 2 * (0 - 1) / 3
    torch.testing.assert_close(vp.grad, torch.tensor([[0.0, -1 / 3, 0.0], [0.0, 0.0, 0.0]]))
    loss, _ = value_loss(VP, OLD, RET, MASK, 0.2, agg="seq-mean-token-mean")
    torch.testing.assert_close(loss, torch.tensor(0.5 * ((0.25 + 1.0) / 2 + 0.0) / 2))
    # a wide clip range never clips: plain 0.5 * MSE = 0.5 * (0.04 + 1 + 0) / 3
    loss, st = value_loss(VP, OLD, RET, MASK, 10.0)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 1.04 / 3))
    assert float(st["vf_clipfrac"]) == 0.0


def test_micro_batch_shares_sum_to_batch_value():
    batch = {"values": OLD, "returns": RET, "response_mask": MASK}
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole, _ = make_critic_loss(0.2, mode)(VP, batch)
        fn = make_critic_loss(0.2, mode, global_denom(MASK, mode))
        parts = [fn(VP[i:i + 1], {k: v[i:i + 1] for k, v in batch.items()})[0]
                 for i in range(2)]
        torch.testing.assert_close(sum(parts), whole)
