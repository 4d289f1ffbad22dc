"""verl 0.9.1's outcome estimators grpo_passk, opo, gpg, gdpo and rloo_vectorized against
verl's own code.

Random ragged batches (groups of 1 to 6 samples in shuffled order, one group whose rewards are
all equal, 0/1 and continuous rewards, [N] scores and [N, T] token rewards, response masks of
one token, short rows, rows after a prompt offset and rows with holes) go through megarl's
`compute_advantages` (for gdpo, `gdpo_advantages`) and, in one child process, through verl's
own `ray_trainer.compute_advantage` (its source, lifted out of the module, whose imports need
packages the reference environment lacks), which calls the registered estimator with exactly
the arguments a verl run gives it: for gdpo the per-component rewards from ``non_tensor_batch``,
placed by ``batch["prompts"]`` and ``batch["attention_mask"]``, and an ``AlgoConfig`` naming
them in ``gdpo_reward_keys``. Advantages and verl's returns (the same tensor for these
estimators) agree to 1e-5.

Where megarl differs on purpose (advantages' module docstring), the comparison says how: a
one-sample group gets 0 in megarl (verl passes its reward through in opo and gpg, and raises in
grpo_passk, which is then compared on the batch without that group); for gdpo, whose batch
whitening a singleton's value would enter, the singleton's components are 0, which both give 0.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.algo.advantages import (ADV_ESTIMATORS, broadcast_to_tokens, compute_advantages,
                                    gdpo_advantages, gpg_advantages, grpo_advantages,
                                    grpo_passk_advantages, masked_whiten, opo_advantages,
                                    rloo_advantages, token_rewards)
from megarl.config import ConfigError, load_config
from megarl.config.schema import CHOICES
from megarl.config.validate import ESTIMATORS_NOT_BUILT
from tests.verl_reference import verl_run

NEW = ("grpo_passk", "opo", "gpg", "rloo_vectorized")
SIZES = (1, 2, 3, 4, 5, 6)   # group sizes; SIZES[0] is the singleton
CONSTANT = 2                 # the group (index into SIZES) whose rewards are all equal
T = 10                       # response columns
TOL = dict(atol=1e-5, rtol=1e-5)
SEEDS = range(6)
GDPO_WEIGHTS = (None, (1.0, 0.5, 2.0))


def _batch(seed: int, holes: bool = True) -> dict:
    """One ragged batch: uids shuffled, masks of 1 token to the whole row."""
    g = torch.Generator().manual_seed(seed)
    uids = [f"p{k}" for k, n in enumerate(SIZES) for _ in range(n)]
    order = torch.randperm(len(uids), generator=g).tolist()
    uids = [uids[i] for i in order]
    N = len(uids)
    binary = seed % 2 == 0
    scores = (torch.randint(0, 2, (N,), generator=g).float() if binary
              else torch.randn(N, generator=g) * 2 + 0.5)
    scores[[i for i, u in enumerate(uids) if u == f"p{CONSTANT}"]] = 1.0 if binary else 0.7
    mask = torch.zeros(N, T)
    for i in range(N):
        start = 0 if not holes else int(torch.randint(0, 3, (1,), generator=g))
        n = 1 if i % 5 == 0 else int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[i, start:start + n] = 1
        if holes and n > 3 and i % 3 == 0:  # a multi-turn hole (tool answer) inside the row
            mask[i, start + 1] = 0
    rewards = scores
    if seed % 3 == 1:  # token rewards, as after a KL penalty in the reward: summed per row
        rewards = token_rewards(scores, mask) - 0.05 * torch.rand(N, T, generator=g) * mask
    return {"uids": uids, "rewards": rewards, "mask": mask}


def _verl_rewards(b: dict) -> torch.Tensor:
    """verl's token_level_rewards of the batch: a score on the last response token."""
    return token_rewards(b["rewards"], b["mask"]) if b["rewards"].dim() == 1 \
        else b["rewards"] * b["mask"]


def _singleton(b: dict) -> torch.Tensor:
    return torch.tensor([u == "p0" for u in b["uids"]])


def _gdpo_batch(seed: int) -> dict:
    """Three reward components per sample; contiguous responses (verl places each component
    on the token before ``attention_mask``'s response length); the singleton's are 0."""
    b = _batch(100 + seed, holes=False)
    g = torch.Generator().manual_seed(seed)
    N = len(b["uids"])
    comps = torch.stack([torch.randint(0, 2, (N,), generator=g).float(),
                         torch.rand(N, generator=g) * 0.2,
                         torch.randn(N, generator=g)])
    constant = torch.tensor([u == f"p{CONSTANT}" for u in b["uids"]])
    comps[:, constant] = torch.tensor([[1.0], [0.1], [-0.3]])
    comps[:, _singleton(b)] = 0.0
    return {**b, "components": comps}


CASES = {(name, seed, norm): _batch(seed) for name in NEW for seed in SEEDS
         for norm in (True, False)}
GDPO_CASES = {(seed, w, norm): _gdpo_batch(seed) for seed in SEEDS[:3] for w in GDPO_WEIGHTS
              for norm in (True, False)}


def _remax_batch(seed: int) -> dict:
    """A batch with each sample's greedy baseline reward (one per prompt, shared by its
    samples, as the rollout gives it)."""
    b = _batch(200 + seed)
    g = torch.Generator().manual_seed(seed)
    per_prompt = {u: float(torch.randn(1, generator=g)) for u in dict.fromkeys(b["uids"])}
    return {**b, "baselines": torch.tensor([per_prompt[u] for u in b["uids"]])}


REMAX_CASES = {seed: _remax_batch(seed) for seed in SEEDS}


def _without(b: dict, drop: torch.Tensor) -> dict:
    keep = (~drop).nonzero().squeeze(-1).tolist()
    return {"uids": [b["uids"][i] for i in keep], "rewards": b["rewards"][keep],
            "mask": b["mask"][keep]}


def _verl_inputs() -> dict:
    runs = {}
    for (name, seed, norm), b in CASES.items():
        runs[(name, seed, norm, "all")] = {
            "name": name, "norm": norm, "uids": b["uids"], "mask": b["mask"],
            "token_level_rewards": _verl_rewards(b)}
        if name == "grpo_passk":  # verl raises on a one-sample group; compare without it
            rest = _without(b, _singleton(b))
            runs[(name, seed, norm, "no_singleton")] = {
                "name": name, "norm": norm, "uids": rest["uids"], "mask": rest["mask"],
                "token_level_rewards": _verl_rewards(rest)}
    for seed, b in REMAX_CASES.items():
        runs[("remax", seed)] = {"name": "remax", "norm": True, "uids": b["uids"],
                                 "mask": b["mask"], "token_level_rewards": _verl_rewards(b),
                                 "reward_baselines": b["baselines"]}
    for (seed, w, norm), b in GDPO_CASES.items():
        runs[("gdpo", seed, w, norm)] = {
            "name": "gdpo", "norm": norm, "uids": b["uids"], "mask": b["mask"],
            "token_level_rewards": _verl_rewards(b), "components": b["components"],
            "weights": w}
    return runs


VERL_CODE = '''
import ast
from typing import Optional

import numpy as np
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator

# ray_trainer.compute_advantage, verl's dispatch from algorithm.adv_estimator to the estimator
# (its module imports torchdata, which the reference environment does not have)
path = core_algos.__file__.replace("core_algos.py", "ray_trainer.py")
fn = next(n for n in ast.parse(open(path).read()).body
          if isinstance(n, ast.FunctionDef) and n.name == "compute_advantage")
ns = {"DataProto": DataProto, "AdvantageEstimator": AdvantageEstimator, "Optional": Optional,
      "AlgoConfig": AlgoConfig, "core_algos": core_algos}
exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), ns)

for key, r in inputs["runs"].items():
    mask = r["mask"]
    tensors = {"token_level_rewards": r["token_level_rewards"], "response_mask": mask}
    if "reward_baselines" in r:  # remax: verl's trainer puts them in the batch
        tensors["reward_baselines"] = r["reward_baselines"]
    non_tensors = {"uid": np.array(r["uids"], dtype=object)}
    extra = {}
    if r["name"] == "gdpo":
        n = mask.shape[0]
        tensors["prompts"] = torch.zeros(n, 3, dtype=torch.long)  # gdpo reads its width
        tensors["attention_mask"] = torch.cat([torch.ones(n, 3), mask], -1).long()
        keys = [f"component_{k}" for k in range(len(r["components"]))]
        for k, c in zip(keys, r["components"]):
            non_tensors[k] = np.array(c.tolist(), dtype=object)
        extra = {"gdpo_reward_keys": keys, "gdpo_reward_weights": r["weights"]}
    config = AlgoConfig(adv_estimator=r["name"], norm_adv_by_std_in_grpo=r["norm"], **extra)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    try:
        out = ns["compute_advantage"](data, adv_estimator=r["name"],
                                      norm_adv_by_std_in_grpo=r["norm"], config=config)
    except Exception as err:
        outputs[key] = {"error": f"{type(err).__name__}: {err}"}
        continue
    outputs[key] = {"advantages": out.batch["advantages"], "returns": out.batch["returns"]}
'''


@pytest.fixture(scope="module")
def verl_out() -> dict:
    return verl_run(VERL_CODE, {"runs": _verl_inputs()})


def _check(ours: torch.Tensor, theirs: dict, rows: torch.Tensor, label) -> None:
    assert "error" not in theirs, (label, theirs)
    for what in ("advantages", "returns"):
        torch.testing.assert_close(ours[rows], theirs[what].float()[rows], **TOL,
                                   msg=lambda m: f"{label} {what}: {m}")


@pytest.mark.parametrize("name", NEW)
def test_matches_verl(verl_out, name):
    for seed in SEEDS:
        for norm in (True, False):
            b = CASES[(name, seed, norm)]
            ours = compute_advantages(name, b["rewards"], b["uids"], b["mask"],
                                      norm_by_std=norm)
            single = _singleton(b)
            assert torch.count_nonzero(ours[single]) == 0  # megarl: no baseline, no signal
            theirs = verl_out[(name, seed, norm, "all")]
            if name == "grpo_passk":
                assert "at least 2 samples" in theirs["error"]
                theirs = verl_out[(name, seed, norm, "no_singleton")]
                _check(ours[~single], theirs, slice(None), (name, seed, norm))
            elif name == "rloo_vectorized":  # 0 for the singleton in verl too
                _check(ours, theirs, slice(None), (name, seed, norm))
            else:
                _check(ours, theirs, ~single, (name, seed, norm))
                # verl passes the singleton's reward through (gpg: times its batch scale)
                assert torch.count_nonzero(theirs["advantages"][single]) > 0 or \
                    torch.count_nonzero(_verl_rewards(b)[single]) == 0


def test_remax_matches_verl(verl_out):
    for seed, b in REMAX_CASES.items():
        ours = compute_advantages("remax", b["rewards"], b["uids"], b["mask"],
                                  baselines=b["baselines"])
        theirs = verl_out[("remax", seed)]
        assert "error" not in theirs, theirs
        # verl's returns are the rewards to go; the advantage subtracts the baseline
        torch.testing.assert_close(ours, theirs["advantages"].float() * b["mask"], **TOL)
    with pytest.raises(ValueError, match="greedy baseline"):
        compute_advantages("remax", b["rewards"], b["uids"], b["mask"])


def test_gdpo_matches_verl(verl_out):
    for (seed, w, norm), b in GDPO_CASES.items():
        # verl's trainer does not pass norm_adv_by_std_in_grpo to gdpo: always the std
        ours = gdpo_advantages(b["components"], b["uids"], b["mask"], w)
        _check(ours, verl_out[("gdpo", seed, w, norm)], slice(None), ("gdpo", seed, w, norm))


def test_the_constant_group_is_exactly_zero():
    for name in NEW:
        b = CASES[(name, 0, True)]
        ours = compute_advantages(name, b["rewards"], b["uids"], b["mask"])
        constant = torch.tensor([u == f"p{CONSTANT}" for u in b["uids"]])
        assert torch.count_nonzero(ours[constant]) == 0, name


def test_hand_computed():
    groups = ["a", "a", "a", "b", "b", "c"]
    r = torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 4.0])
    # passk: a's best (3) beats the runner-up (2) by 1, over a's std 1; b's max is shared
    torch.testing.assert_close(grpo_passk_advantages(r, groups, eps=0.0),
                               torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(grpo_passk_advantages(r, groups, norm_by_std=False),
                               torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    # opo: a's baseline (1*1 + 3*1 + 2*2) / 4 = 2
    torch.testing.assert_close(opo_advantages(r, groups, torch.tensor([1, 1, 2, 3, 1, 1])),
                               torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    # gpg: 6 samples, 5 nonzero rewards -> alpha 6/5 on r - mean_g
    r0 = torch.tensor([0.0, 3.0, 2.0, 5.0, 5.0, 4.0])
    torch.testing.assert_close(gpg_advantages(r0, groups),
                               1.2 * torch.tensor([-5 / 3, 4 / 3, 1 / 3, 0.0, 0.0, 0.0]))
    # gdpo with one component, no weights: GRPO's group advantage, whitened over tokens
    mask = torch.ones(6, 2)
    want = masked_whiten(broadcast_to_tokens(grpo_advantages(r, groups), mask), mask)
    torch.testing.assert_close(gdpo_advantages(r[None], groups, mask), want)
    with pytest.raises(ValueError, match="2 weights for 1 reward components"):
        gdpo_advantages(r[None], groups, mask, weights=(1.0, 2.0))


def test_rloo_vectorized_is_rloo():
    b = CASES[("rloo_vectorized", 1, True)]
    torch.testing.assert_close(
        compute_advantages("rloo_vectorized", b["rewards"], b["uids"], b["mask"]),
        compute_advantages("rloo", b["rewards"], b["uids"], b["mask"]))


# ------------------------------------------------------------------ config -> the estimator
def test_config_choices_are_the_estimators():
    assert set(CHOICES["algorithm.adv_estimator"]) == set(ADV_ESTIMATORS)
    assert not set(ESTIMATORS_NOT_BUILT) & set(ADV_ESTIMATORS)


@pytest.mark.parametrize("name", NEW)
def test_config_reaches_the_estimator_through_the_train_step(name):
    """`algorithm.adv_estimator` from a loaded config, through the TRAIN state's
    `steps.advantages` (the run's one call of compute_advantages)."""
    from types import SimpleNamespace

    from megarl.controller.steps import advantages

    b = CASES[(name, 3, False)]
    cfg = load_config(None, [f"algorithm.adv_estimator={name}",
                             "algorithm.norm_adv_by_std_in_grpo=false"])
    rec = SimpleNamespace(step=0, samples=[SimpleNamespace(uid=u) for u in b["uids"]],
                          batch={"rewards": b["rewards"], "response_mask": b["mask"]})
    advantages(SimpleNamespace(cfg=cfg), rec)
    scores = b["rewards"] if b["rewards"].dim() == 1 else b["rewards"].sum(-1)
    direct = {"grpo_passk": lambda: grpo_passk_advantages(scores, b["uids"], False),
              "opo": lambda: opo_advantages(scores, b["uids"], b["mask"].sum(-1)),
              "gpg": lambda: gpg_advantages(scores, b["uids"]),
              "rloo_vectorized": lambda: rloo_advantages(scores, b["uids"])}[name]()
    torch.testing.assert_close(rec.batch["advantages"], broadcast_to_tokens(direct, b["mask"]))
    assert not torch.allclose(rec.batch["advantages"], compute_advantages(
        "grpo", b["rewards"], b["uids"], b["mask"]))


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_unknown_and_unbuilt_names_are_config_errors_naming_the_key():
    msg = _error("algorithm.adv_estimator=grpo_pask")
    assert msg.startswith("algorithm.adv_estimator:") and "did you mean `grpo_passk`?" in msg
    for name in ("grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline"):
        msg = _error(f"algorithm.adv_estimator={name}")
        assert msg.startswith(f"algorithm.adv_estimator: verl's {name!r} is not built"), msg
    gdpo = ("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]")
    assert _error("algorithm.adv_estimator=gdpo").startswith("algorithm.gdpo_reward_keys:")
    assert "2 gdpo_reward_keys" in _error(*gdpo, "algorithm.gdpo_reward_weights=[1.0]")
    assert "use_kl_in_reward would have no effect" in _error(*gdpo,
                                                             "algorithm.use_kl_in_reward=true")
    assert "overlong penalty" in _error(
        *gdpo, "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "reward.reward_kwargs.overlong_buffer_cfg.len=4")
    assert "norm_adv_by_std_in_grpo" in _error(*gdpo, "algorithm.norm_adv_by_std_in_grpo=false")
    msg = _error("algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1")
    assert msg.startswith("algorithm.adv_estimator:") and "rollout.n=1" in msg
    msg = _error("algorithm.adv_estimator=remax",
                 "actor_rollout_ref.rollout.rollout_fn=megarl.controller.trajectory:make_policy")
    assert msg.startswith("algorithm.adv_estimator: remax's greedy baseline") and \
        "rollout.rollout_fn replaces them" in msg


def test_unknown_name_stops_the_cli_before_the_controller_starts(monkeypatch, capsys):
    import sys
    import types

    from megarl.cli import main

    started = []
    fake = types.ModuleType("megarl.controller.driver")
    fake.run = lambda cfg, val_only=False: started.append(cfg)
    monkeypatch.setitem(sys.modules, "megarl.controller.driver", fake)
    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    for name in ("grpo_pask", "grpo_vectorized"):
        assert main(["train", "--config", quickstart, f"algorithm.adv_estimator={name}"]) == 2
        assert "algorithm.adv_estimator" in capsys.readouterr().err and not started
    assert main(["train", "--config", quickstart, "algorithm.adv_estimator=opo"]) == 0
    assert started[0].algorithm.adv_estimator == "opo"


def test_gdpo_takes_the_reward_dicts_components_through_the_train_step():
    """The components a reward function returned (kept by the pool beside the score, on each
    Sample) reach gdpo through `steps.advantages`, weighted as configured; a failed call's
    sample counts reward.failure_score in each; a missing entry is an error naming the key."""
    from types import SimpleNamespace

    from megarl.controller.steps import advantages
    from megarl.observability.metrics import MetricsTracker

    b = GDPO_CASES[(SEEDS[0], GDPO_WEIGHTS[-1], True)]
    comps = b["components"].clone()
    comps[:, 2] = -1.5  # sample 2's call failed: every component is the failure score
    extras = [{"fmt": float(comps[0, i]), "acc": float(comps[1, i]), "len": float(comps[2, i]),
               "pred": 3.0} for i in range(len(b["uids"]))]
    extras[2] = None
    cfg = load_config(None, ["algorithm.adv_estimator=gdpo",
                             "algorithm.gdpo_reward_keys=[fmt,acc,len]",
                             "algorithm.gdpo_reward_weights=[1.0,0.5,2.0]",
                             "reward.failure_score=-1.5"])
    samples = [SimpleNamespace(uid=u, reward_extra=e, data_source="d")
               for u, e in zip(b["uids"], extras)]
    rec = SimpleNamespace(step=0, samples=samples,
                          batch={"rewards": torch.zeros(len(samples)), "response_mask": b["mask"]})
    st = SimpleNamespace(cfg=cfg, metrics=MetricsTracker())
    advantages(st, rec)
    torch.testing.assert_close(rec.batch["advantages"], gdpo_advantages(
        comps, b["uids"], b["mask"], [1.0, 0.5, 2.0]))
    got = st.metrics.pop(0)
    assert got["gdpo/acc/mean"] == pytest.approx(float(comps[1].mean()))
    assert got["gdpo/len/min"] == pytest.approx(float(comps[2].min()))
    samples[5].reward_extra = {"fmt": 1.0}
    with pytest.raises(RuntimeError, match=r"gdpo_reward_keys: 'acc' is not among .*\['fmt'\]"):
        advantages(st, rec)
