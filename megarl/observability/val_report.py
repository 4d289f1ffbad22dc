"""What a validation reports: its metrics (megarl's aggregate `val/*` and verl's per-data-source
`val-core/*`, `val-aux/*`) and the generations `trainer.log_val_generations` shows.

verl 0.9.1 reports a validation per data source (``process_validation_metrics`` and
``RayPPOTrainer._val_metrics_update``), and so does megarl, under the same names:

    val-core/<data_source>/<var>/<metric>     the headline numbers
    val-aux/<data_source>/<var>/<metric>      the rest

``<var>`` is what was measured per response (``VARIABLES``); ``<metric>`` is, over the
``n = val_kwargs.n`` responses of each prompt, then averaged over the source's prompts:
``mean@n``, and with n > 1 ``std@n`` and, for k = 2, 4, ... < n and k = n, the bootstrap
``best@k/{mean,std}`` and ``worst@k/{mean,std}`` (1000 draws of k responses, seed 42, as
verl). A metric is core when its var is the core one (``acc`` when present, else ``reward``),
it is a mean or best, and it is taken at k = n; everything else is aux.

What this leaves out of verl's: ``maj@k`` (needs the reward function's ``pred``, which megarl's
reward pool does not keep; it keeps only the score) and ``val-aux/num_turns/*``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

VARIABLES = {
    # verl's var      what megarl measures for it, per response
    "reward": "the reward that trains: the reward function's score plus any overlong "
              "penalty (verl: the reward tensor's sum)",
    "acc": "the reward function's own score (verl's reward loop sets acc = score when the "
           "function returns a number)",
    "overlong_reward": "the overlong penalty, <= 0 (only with overlong_buffer_cfg.log)",
    "overlong": "1 when the penalty applied, else 0 (only with overlong_buffer_cfg.log)",
}
"""The per-response variables megarl reports, by verl's names (docs/observability.md)."""

N_BOOTSTRAP = 1000
SEED = 42


def _ks(n: int) -> list[int]:
    """Subset sizes for best@k/worst@k: 2, 4, 8, ... below n, then n (verl's gen_ns)."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


_draws: dict[tuple[int, int], np.ndarray] = {}


def _bootstrap_idx(n: int, k: int) -> np.ndarray:
    """verl's draws: np.random.seed(42) then choice(n, (1000, k)); the same numbers from a
    RandomState of its own, so the process's global RNG is left alone."""
    if (n, k) not in _draws:
        _draws[(n, k)] = np.random.RandomState(SEED).choice(n, size=(N_BOOTSTRAP, k),
                                                            replace=True)
    return _draws[(n, k)]


def _prompt_metrics(values: Sequence[float]) -> dict[str, float]:
    """One prompt's responses: mean@n, std@n, best@k/*, worst@k/*."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    out = {f"mean@{n}": float(x.mean())}
    if n > 1:
        out[f"std@{n}"] = float(x.std())
        for k in _ks(n):
            drawn = x[_bootstrap_idx(n, k)]
            best, worst = drawn.max(axis=1), drawn.min(axis=1)
            out[f"best@{k}/mean"], out[f"best@{k}/std"] = float(best.mean()), float(best.std())
            out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = (float(worst.mean()),
                                                             float(worst.std()))
    return out


def per_source_metrics(data_sources: Sequence[str], uids: Sequence[str],
                       infos: Mapping[str, Sequence]) -> dict[str, float]:
    """verl's `val-core/...` and `val-aux/...` for responses i with `data_sources[i]`, prompt
    `uids[i]` and `infos[var][i]` (None: not measured for that response)."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (src, uid) in enumerate(zip(data_sources, uids)):
        for var, values in infos.items():
            if values[i] is not None:
                grouped[src][var][uid].append(values[i])
    out: dict[str, float] = {}
    for src, by_var in grouped.items():
        core_var = "acc" if "acc" in by_var else "reward"
        for var, by_uid in by_var.items():
            per_metric: dict[str, list[float]] = defaultdict(list)
            for vals in by_uid.values():
                for name, v in _prompt_metrics(vals).items():
                    per_metric[name].append(v)
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in per_metric)
            for name, vals in per_metric.items():
                core = (var == core_var and name.startswith(("mean", "maj", "best"))
                        and f"@{n_max}" in name)
                out[f"{'val-core' if core else 'val-aux'}/{src}/{var}/{name}"] = float(
                    np.mean(vals))
    return out


def validation_metrics(samples: Sequence, rewards: Sequence[float], *,
                       log_overlong: bool = False) -> dict[str, float]:
    """A validation's metrics from its scored samples (`megarl.controller.batch.Sample`, in
    prompt order) and their rewards: the aggregate `val/*` and verl's per-source ones."""
    n = max(1, len(rewards))
    m = {"val/reward_mean": sum(rewards) / n,
         "val/exact_frac": sum(x >= 1.0 for x in rewards) / n,
         # ended by a stop token (EOS) rather than cut at the length cap
         "val/eos_frac": sum(s.finish == "stop" for s in samples) / n,
         "val/response_length_mean": sum(len(s.response_ids) for s in samples) / n}
    scores = [r if s.score is None else s.score for s, r in zip(samples, rewards)]
    infos: dict[str, list] = {"reward": list(rewards), "acc": scores}
    if log_overlong:
        penalty = [r - a for r, a in zip(rewards, scores)]
        infos["overlong_reward"] = penalty
        infos["overlong"] = [float(p < 0) for p in penalty]
    # the other numbers of the dicts the reward function returned (verl logs each such key
    # as a variable): those every response has
    extras = [getattr(s, "reward_extra", None) for s in samples]
    if extras and all(extras):
        for key in extras[0]:
            if key not in infos and all(key in e for e in extras):
                infos[key] = [e[key] for e in extras]
    m.update(per_source_metrics([s.data_source for s in samples], [s.uid for s in samples],
                                infos))
    return m


def generation_rows(samples: Sequence, rewards: Sequence[float], tokenizer,
                    n: int) -> list[dict]:
    """The first `n` responses of a validation (prompt order; a prompt's samples in turn) as
    rows {data_source, prompt, response, score}: the prompt decoded without special tokens
    (as verl does), the score the reward that trains. Both pick the same rows at every
    validation: megarl the first of `data.val_files`, verl n after a seeded shuffle of the
    prompts sorted by text."""
    return [{"data_source": s.data_source,
             "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
             "response": s.response_text, "score": float(r)}
            for s, r in zip(samples[:n], rewards[:n])]
