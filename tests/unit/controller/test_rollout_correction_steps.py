"""``algorithm.rollout_correction`` in the run's states (controller/steps.py), with fake worker
groups: TRAIN hands the actor the corrected batch (verl's weights and rejections, computed
once over the whole step's batch) and logs ``rollout_corr/...``, while the advantages keep
the batch's own mask; bypass mode skips the LOGP pass and hands the actor the batch as is."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from megarl.algo.rollout_correction import RolloutCorrection, correct_batch
from megarl.config import load_config
from megarl.controller import steps
from megarl.controller.batch import StepRecord
from megarl.observability.metrics import MetricsTracker

RC = "algorithm.rollout_correction"
N, S = 8, 12  # 4 prompts x 2 samples


class Actor:
    def __init__(self):
        self.trained, self.logp_calls = [], 0

    async def train(self, mini_batches, micro, temperature):
        self.trained.extend(mini_batches)
        return [{"actor/pg_loss": 0.0} for _ in mini_batches]

    async def compute_logp(self, *args, **kwargs):
        self.logp_calls += 1
        raise AssertionError("bypass mode runs no LOGP pass")


def _state(tmp_path, *overrides):
    cfg = load_config(None, ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4", *overrides])
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(N, S)
    for i in range(N):
        mask[i, 3:3 + 2 + i % 7] = 1
    old = (torch.rand(N, S, generator=g) * 0.9 + 0.05).log()
    behav = old + torch.randn(N, S, generator=g) * torch.linspace(0.05, 2.0, N)[:, None]
    batch = {"input_ids": torch.randint(0, 100, (N, S), generator=g),
             "attention_mask": torch.ones(N, S), "response_mask": mask,
             "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 1.0, 0.2]),
             "rollout_logprobs": behav * mask, "old_logprobs": old,
             "token_versions": torch.zeros(N, S, dtype=torch.long)}
    samples = [SimpleNamespace(uid=f"p{i // 2}") for i in range(N)]
    rec = StepRecord(step=0, resume_before={}, samples=samples, batch=batch)
    actor = Actor()
    run = SimpleNamespace(actor=actor, critic=None, logp=None,
                          plan=SimpleNamespace(temperature=1.0, ckpt_root=tmp_path))
    st = SimpleNamespace(run=run, cfg=cfg, metrics=MetricsTracker(), kl_coef=0.0)
    return st, rec, actor


def test_train_hands_the_actor_the_corrected_batch(tmp_path):
    keys = [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=true",
            f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold='0.7_1.4'"]
    st, rec, actor = _state(tmp_path, *keys)
    mask = rec.batch["response_mask"].clone()
    asyncio.run(steps.train(st, rec))
    rc = RolloutCorrection.from_config(st.cfg.algorithm.rollout_correction)
    w, kept, metrics = correct_batch(rec.batch["old_logprobs"], rec.batch["rollout_logprobs"],
                                     mask, rc)
    assert 0 < float(kept.sum()) < float(mask.sum())  # some responses rejected, not all
    trained = {k: torch.cat([mb[k] for mb in actor.trained])
               for k in ("response_mask", "rollout_is_weights", "advantages")}
    assert torch.equal(trained["response_mask"], kept)
    torch.testing.assert_close(trained["rollout_is_weights"], w)  # normalised over all N
    # the advantages (and the step's own batch) keep every token
    assert torch.equal(rec.batch["response_mask"], mask)
    assert (trained["advantages"][(mask > 0) & (kept == 0)] != 0).any()
    logged = st.metrics.get(0)
    assert logged["rollout_corr/is/batch_norm_factor"] == \
        metrics["rollout_corr/is/batch_norm_factor"]
    assert "rollout_corr/rs/seq_mean_k1/seq_masked_fraction" in logged
    assert "rollout_corr/offpolicy/kl" in logged


def test_without_the_section_the_actor_gets_the_batch_and_the_diagnostics_are_logged(tmp_path):
    st, rec, actor = _state(tmp_path)
    asyncio.run(steps.train(st, rec))
    assert all("rollout_is_weights" not in mb for mb in actor.trained)
    assert torch.equal(torch.cat([mb["response_mask"] for mb in actor.trained]),
                       rec.batch["response_mask"])
    assert "rollout_corr/offpolicy/chi2_token" in st.metrics.get(0)


def test_bypass_mode_skips_logp_and_trains_on_the_batch_as_is(tmp_path):
    st, rec, actor = _state(tmp_path, f"{RC}.bypass_mode=true")
    del rec.batch["old_logprobs"]
    asyncio.run(steps.logp(st, rec))
    assert actor.logp_calls == 0
    assert rec.batch["old_logprobs"] is rec.batch["rollout_logprobs"]
    asyncio.run(steps.train(st, rec))
    assert not any(k.startswith("rollout_corr/") for k in st.metrics.get(0))
    assert torch.equal(torch.cat([mb["response_mask"] for mb in actor.trained]),
                       rec.batch["response_mask"])
