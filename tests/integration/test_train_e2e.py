"""`megarl train` end to end on the quickstart task: real Ray, Megatron, embedded engines.

Each run is a subprocess (its own Ray instance) on a shared tiny model and synthetic task.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from design_usage import DESIGN_OVERRIDES as DESIGN_KEYS
from launch_helpers import ROOT



def _args(assets, run_dir, *extra):
    return ["--config", str(ROOT / "configs" / "quickstart.yaml"),
            f"actor_rollout_ref.model.path={assets / 'tiny'}",
            f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=t", *extra]


def megarl(cmd, args, timeout=600, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    full = [sys.executable, "-m", "megarl.cli", cmd, *args]
    if popen:
        return subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, **popen)
    p = subprocess.run(full, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(full)} -> {p.returncode}\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-6000:]}"
    return p.stdout + p.stderr


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "megarl" / "t" / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def trained(run_dir, field="uids"):
    """step -> uids of the last record for that step (a killed run may have written more);
    `field="filtered"`: the prompts dynamic sampling dropped in that step."""
    out = {}
    f = Path(run_dir) / "megarl" / "t" / "trained_prompts.jsonl"
    for line in f.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec.get(field, [])
    return out


def fresh_loader(assets):
    """The quickstart's prompt loader as a new run builds it: the seeded order of draws."""
    from megarl.config import load_config
    from megarl.data.dataset import load_split
    from megarl.data.loader import PromptLoader
    from transformers import AutoTokenizer

    cfg = load_config(None, [f"data.train_files={assets / 'data' / 'train.jsonl'}",
                             "data.train_batch_size=8", "data.max_prompt_length=64"])
    tok = AutoTokenizer.from_pretrained(assets / "tiny")
    return PromptLoader(load_split(cfg.data, tok), 8, shuffle=cfg.data.shuffle,
                        seed=cfg.data.seed)


MODES = {
    # (colocated on-policy, every task on one device and one step ahead, was dropped for the
    # suite's time: the agent e2e trains colocated, test_dual_buffer_synchronous_run_on_two_nodes
    # synchronously)
    # (the quickstart's own layout, two groups one step off, trains in every other test here
    # that runs configs/quickstart.yaml, e.g. test_a_lost_trainer_worker_restarts_...)
    # three steps ahead, trained as a GPU trains: bf16 params, Megatron's optimizer keeping
    # fp32 main params, the weight sync casting into the fp32 engine; and every pass in
    # packed micro-batches of at most 96 tokens (verl's use_dynamic_bsz); the loss GSPO's
    # (sequence-level ratio, its recipe's clip ranges and aggregation) with DAPO's dynamic
    # sampling and overlong penalty (one run for both: the suite's time); its trainer on two
    # devices at context parallelism 2 (each sequence split over both ranks, packed rows cut
    # per sequence): a CP run learns
    "ahead-3-bf16-packed-gspo-dapo-cp2": [
        "trainer.generate_ahead_steps=3", "trainer.n_gpus_per_node=3",
        "trainer.separated_node_ratios=[0.6666666666666666,0.3333333333333334]",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "actor_rollout_ref.actor.megatron.params_dtype=bfloat16",
        "actor_rollout_ref.ref.megatron.params_dtype=bfloat16",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=4e-4",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "reward.reward_kwargs.overlong_buffer_cfg.log=true"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_reward_rises(quickstart_assets, tmp_path, mode):
    out = megarl("train", _args(quickstart_assets, tmp_path, "trainer.save_freq=-1",
                                "trainer.test_freq=-1", "trainer.val_before_train=False",
                                *MODES[mode]))
    reward = scalars(tmp_path, "reward/mean")
    assert sorted(reward) == list(range(1, 41)), out[-2000:]
    first = sum(reward[s] for s in range(1, 9)) / 8
    last = sum(reward[s] for s in range(33, 41)) / 8
    assert last > first + 0.1, (mode, first, last)
    stale = scalars(tmp_path, "rollout/staleness_max")
    ahead = {"ahead-3-bf16-packed-gspo-dapo-cp2": 3}[mode]
    if "gspo-dapo" in mode:  # each step full after its dropped groups; the penalty on
        kept = scalars(tmp_path, "rollout/filter_groups/kept_groups")
        assert sorted(kept) == list(range(1, 41)) and set(kept.values()) == {8.0}
        assert sum(scalars(tmp_path, "rollout/filter_groups/filtered_groups").values()) >= 1
        assert min(scalars(tmp_path, "reward/overlong_penalty_mean").values()) < 0
    if "packed" in mode:  # several packed micro-batches per step, no padding computed
        padding = set(scalars(tmp_path, "actor/padding_frac").values())
        # but CP's: each sequence to a multiple of 2·CP = 4 positions, at most 3 of a sequence
        # (prompts here are over 9 tokens; a step's measured maximum was 0.10)
        assert (0 < max(padding) < 0.25 if "cp2" in mode else padding == {0.0}), padding
        assert min(scalars(tmp_path, "actor/micro_batches").values()) >= 2
    # samples are never more than a-1 versions behind, and off-policy modes really are behind
    assert max(stale.values()) <= ahead - 1
    if ahead > 1:
        assert max(stale.values()) >= 1
    # importance weights: maxima reduce with max (never below the mean, as a sum could be)
    w_mean, w_max = scalars(tmp_path, "actor/tis_weight_mean"), scalars(tmp_path,
                                                                          "actor/tis_weight_max")
    assert sorted(w_max) == list(range(1, 41))
    assert all(w_max[s] >= w_mean[s] - 1e-6 for s in w_max)
    assert max(scalars(tmp_path, "actor/ratio_max").values()) < 50
    # scored by the streaming reward pool: every response once, none failed
    calls = scalars(tmp_path, "reward/calls")
    assert sum(calls.values()) >= 40 * 32 and not any(scalars(tmp_path,
                                                               "reward/failures").values())
    check_timeline(tmp_path, 40)


def check_timeline(run_dir, steps: int, every: int = 10) -> None:
    """The run's timeline files: the trace holds every interval, and each task's summed
    intervals in a step are the step's `timing/<task>`; the picture is in TensorBoard every
    `every` steps (trainer.timeline_freq)."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megarl.observability.metrics import TIMING_NAME

    run = Path(run_dir) / "megarl" / "t"
    events = [e for e in json.loads((run / "timeline.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    summed = {}
    for e in events:
        key = (e["cat"], e["args"]["step"])
        summed[key] = summed.get(key, 0.0) + e["dur"] / 1e6
    tasks = {task for task, _ in summed}
    assert {"generate", "actor-train", "sync"} <= tasks, tasks
    for task in tasks:
        timing = scalars(run_dir, f"timing/{TIMING_NAME[task]}")
        assert sorted(timing) == list(range(1, steps + 1)), task
        for k in range(steps):
            assert summed[(task, k)] == pytest.approx(timing[k + 1], rel=0.05), (task, k)
    with Image.open(run / "timeline.png") as img:
        assert img.size[0] > 0 and len(img.convert("RGB").getcolors(1 << 24)) > 3  # not blank
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [i.step for i in acc.Images("timeline")] == list(range(every, steps + 1, every))


@pytest.mark.stock_sglang
def test_sglang_backend_trains_on_stock_servers(quickstart_assets, tmp_path, stock_python):
    """`rollout.name=sglang` as users run it on a CPU: megarl launches a stock
    `sglang.launch_server` of TP 2 from its own environment (found without any key; each TP
    rank holds its own rank of the trainer's update group: world 1 + 2), each version goes
    begin -> flattened buckets -> end -> flush -> continue, and the run learns as the
    embedded one does, with partial rollout aborting the tail and continuing it across syncs
    (its tokens' versions come from the server's spans). (Two stock servers beside one
    trainer: tests/stock/test_stock_weight_sync_pp.py; one server was enough here, and two
    of TP 2 on two cores made this the suite's slowest test.)"""
    out = megarl("train", _args(
        quickstart_assets, tmp_path, "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=False", "trainer.n_gpus_per_node=3",
        "trainer.separated_node_ratios=[0.3333333333333333,0.6666666666666666]",
        # 1 trainer process, 1 engine of TP 2
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.partial_rollout=True",
        "actor_rollout_ref.rollout.server_extra_args=[--log-level,info]"), timeout=900)
    reward = scalars(tmp_path, "reward/mean")
    assert sorted(reward) == list(range(1, 41)), out[-2000:]
    first = sum(reward[s] for s in range(1, 9)) / 8
    last = sum(reward[s] for s in range(33, 41)) / 8
    assert last > first + 0.1, (first, last)
    # the server started from dummy weights and got the trainer's before the first rollout:
    # step 1 is on-policy, its log-probs the trainer's (from dummy weights the mean was 0.64)
    assert scalars(tmp_path, "rollout/logp_mismatch_mean")[1] < 1e-3
    # the tail was aborted on the stock servers, cached and continued after syncs: the
    # continued samples hold tokens of several versions, read from the servers' spans
    assert sum(scalars(tmp_path, "rollout/partial/aborted_requests").values()) > 0
    assert sum(scalars(tmp_path, "rollout/partial/resumed_groups").values()) > 0
    assert max(scalars(tmp_path, "rollout/partial/versions_spanned_max").values()) >= 2
    paused = scalars(tmp_path, "weight_sync/engine_pause_s")
    assert paused and all(v > 0 for v in paused.values())
    assert "rank offsets [1]" in out and "sglang.launch_server" in out
    assert "--tp-size 2" in out
    assert stock_python in out  # the server ran from the stock environment
    # each TP rank of the server joined the trainer's update group as its own rank
    log = (tmp_path / "megarl" / "t" / "logs" / "rollout-0.log").read_text()
    for rank in (1, 2):
        assert f"rank={rank}, world_size=3" in log, log[-2000:]


def test_given_servers_and_an_engine_failing_mid_version_is_dropped(quickstart_assets,
                                                                   tmp_path):
    """`rollout.server_urls`: servers the user runs (nothing launched). One of them answers
    its 3rd weight-update call with `success: false`: it is marked stale (version "stale"),
    its requests go to the other engine, and training finishes, never hanging."""
    from megarl.backends.sglang.launcher import ServerArgs, find_free_port, launch_server

    servers = []
    try:
        for fault in ([], ["--fail-update-at", "3"]):
            args = ServerArgs(model_path=str(quickstart_assets / "tiny"),
                              port=find_free_port(), load_format="dummy", weight_version="0",
                              log_level="info", extra_args=["--sglang-contract", *fault])
            servers.append(launch_server(args, module="megarl.rollout.server", timeout_s=120,
                                         log_path=tmp_path / f"server{len(servers)}.log"))
        urls = ",".join(s.url for s in servers)
        out = megarl("train", _args(
            quickstart_assets, tmp_path, "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=False", "trainer.total_training_steps=6",
            "actor_rollout_ref.rollout.name=sglang",
            f"actor_rollout_ref.rollout.server_urls=[{urls}]"), timeout=300)
    finally:
        for s in servers:
            s.stop()
    assert sorted(scalars(tmp_path, "reward/mean")) == list(range(1, 7)), out[-2000:]
    assert f"engine {servers[1].url} marked stale" in out
    assert "injected fault" in (tmp_path / "server1.log").read_text()
    assert max(scalars(tmp_path, "weight_sync/stale_engines").values()) == 1



def test_design_usage_keys_run_a_short_training(quickstart_assets, tmp_path):
    out = megarl("train", _args(quickstart_assets, tmp_path, *DESIGN_KEYS,
                                "trainer.n_gpus_per_node=4",
                                "trainer.total_training_steps=3", "trainer.save_freq=-1",
                                "trainer.test_freq=-1", "trainer.val_before_train=False"))
    assert sorted(trained(tmp_path)) == [0, 1, 2]
    assert "group ref_logp: 1 cpu device(s)" in out and "group generate: 1 cpu" in out
    assert sorted(scalars(tmp_path, "weight_sync/blocking_s")) == [1, 2, 3]


def check_saves_overlap_generation(run_dir, saved: int, steps: int, save_freq: int) -> None:
    """CHECKPOINT is an action of the trainer's group, not a stall of the driver: in the
    resumed run's timeline every due step is saved once, after its SYNC and before the next
    TRAIN, and generation one step off goes on while a step is saved (GENERATE(k+2) overlaps
    CHECKPOINT(k); a save that blocked the driver would have kept it from starting)."""
    events = [e for e in json.loads((Path(run_dir) / "megarl" / "t" / "timeline.json")
                                    .read_text())["traceEvents"]
              if e["ph"] == "X" and not e["args"].get("earlier")]  # the resumed run's own
    span = {(e["cat"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in events}
    saves = sorted(k for task, k in span if task == "checkpoint")
    # 0-based step k completes k+1 steps: the resumed run (from global_step_<saved>) ran
    # steps saved.. and saved every save_freq completed steps
    assert saves == [k for k in range(saved, steps) if (k + 1) % save_freq == 0], saves
    for k in saves:
        start, end = span[("checkpoint", k)]
        assert start >= span[("sync", k)][1]
        if ("actor-train", k + 1) in span:
            assert span[("actor-train", k + 1)][0] >= end
    overlapped = [k for k in saves if ("generate", k + 2) in span
                  and span[("generate", k + 2)][0] < span[("checkpoint", k)][1]]
    assert overlapped, {k: (span[("checkpoint", k)], span.get(("generate", k + 2)))
                        for k in saves}
    assert scalars(run_dir, "timing/checkpoint")


# (A run killed as a whole and started again, resuming from its newest checkpoint with each
# step's batch an uninterrupted run's, the saves overlapping generation: torchrun's restarts,
# test_torchrun_launch.py::test_a_trainer_rank_killed_twice_restarts_the_run_which_trains_
# exactly, where each life is new processes resuming as a run started by hand would; and the
# Slurm job requeued, test_slurm_launch.py. Validation-only on a run's latest checkpoint, its
# weights served and nothing trained: test_slurm_launch.py::test_validate_job_serves_the_
# checkpoint_weights.)


def test_validation_only_mode(quickstart_assets, tmp_path, monkeypatch):
    """`megarl validate` with no checkpoint: the model's own weights, no trainer started;
    reported to every logger (W&B offline, MLflow in the run directory's store) with verl's
    per-source metrics and two generations."""
    from tracking_readers import mlflow_json_artifact, mlflow_run, wandb_offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for var in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    out = megarl("validate", _args(quickstart_assets, tmp_path,
                                   "trainer.logger=[console,tensorboard,wandb,mlflow]",
                                   "trainer.log_val_generations=2"))
    assert "val/reward_mean=" in out
    assert 0 in scalars(tmp_path, "val/reward_mean")
    run_dir = tmp_path / "megarl" / "t"
    assert not (run_dir / "trained_prompts.jsonl").exists()
    assert "actor model" not in out  # no trainer was started
    core = "val-core/megarl/quickstart/acc/mean@1"  # data_source megarl/quickstart, greedy
    assert scalars(tmp_path, core)[0] == pytest.approx(scalars(tmp_path, "val/reward_mean")[0])
    rows = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text()
            .splitlines()]
    assert [(r["step"], r["data_source"]) for r in rows] == [(0, "megarl/quickstart")] * 2
    (wb,) = wandb_offline_runs(run_dir)
    assert (wb.project, wb.name) == ("megarl", "t") and wb.config["trainer"]["val_only"]
    assert list(wb.metric(core)) == [0]
    assert [r["val/generations/nrows"] for r in wb.history if "val/generations/nrows" in r] == [2]
    client, ml = mlflow_run(f"sqlite:///{run_dir / 'mlflow.db'}", "megarl", "t")
    assert ml.data.metrics[core.replace("@", "_at_")] == pytest.approx(
        scalars(tmp_path, core)[0])
    assert mlflow_json_artifact(client, ml.info.run_id, "val_generations/step_0.json") == rows


def _kill_a_trainer_worker_after_checkpoints(proc, run_dir, after: list[int],
                                             signals: list[int]) -> tuple[str, int]:
    """Send `signals[i]` (SIGKILL: lost; SIGSTOP: wedged, alive but answering nothing) to one
    actor/ref worker process of a Ray run once the checkpoint of step `after[i]` exists (a
    new worker each time: the run restarted); wait for the run to end by itself. (its
    output, exit status)"""
    import threading

    import psutil

    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed = set()
    try:
        for i, (step, sig) in enumerate(zip(after, signals)):
            # a checkpoint of at least `step` saved by the run as restarted i times (not one
            # the previous try saved, nor one its set-up is still loading)
            deadline = time.time() + 300
            while proc.poll() is None and time.time() < deadline:
                text = "".join(lines)
                since = text.split(f"restart {i}/", 1)[-1] if i else text
                if any(int(k) >= step for k in re.findall(r"checkpoint after step (\d+) saved",
                                                          since)):
                    break
                time.sleep(0.05)
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "ray::MegatronActor" in " ".join(p.cmdline()) and p.pid not in killed]
            assert workers and proc.poll() is None, "".join(lines)[-3000:]
            workers[0].send_signal(sig)
            killed.add(workers[0].pid)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=30)
    return "".join(lines), proc.returncode


def MOE_R3(where) -> list[str]:
    """A tiny Qwen3-MoE (made by the run in `where`/moe) at EP=2 over two trainer ranks,
    with routing replay: the engines' routing travels with every sample, cached partial
    groups and checkpoints included. No KL loss, so no reference model: two processes fewer
    in each of the run's lives (the suite's time)."""
    return [f"actor_rollout_ref.model.path={where / 'moe'}",
            "actor_rollout_ref.model.make_tiny=qwen3_moe", "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            "actor_rollout_ref.actor.router_replay.mode=R3"]


def test_a_lost_trainer_worker_restarts_the_run_which_trains_every_prompt_once(
        quickstart_assets, tmp_path):
    """`trainer.max_restarts=2`, with partial rollout (unfinished groups cached across steps
    and checkpoints) and dynamic sampling (`algorithm.filter_groups`: groups whose rewards
    are all the same dropped) and GDPO (a reward dict's components, cached and checkpointed
    with their samples), on a mixture of experts at EP=2 with routing replay (`MOE_R3`): a
    trainer worker SIGKILLed once the checkpoint of step 2 exists, and
    another (of the restarted run) wedged by SIGSTOP once that of step 4 does: alive, so
    nothing reports it lost, its state runs past `trainer.state_timeout_s` and fails by name.
    The same `megarl train` restarts itself from its newest checkpoint each time and
    finishes: every prompt it drew trained or dropped exactly once (trained + dropped + still
    cached = drawn),
    each restart a metric and an incident. (The same losses under torchrun, each life new
    processes resuming as a run started again by hand: test_torchrun_launch.py.)"""
    extra = ["trainer.total_training_steps=8", "trainer.save_freq=2", "trainer.test_freq=-1",
             "trainer.val_before_train=False", "actor_rollout_ref.rollout.partial_rollout=True",
             "actor_rollout_ref.rollout.over_sample_prompts=6", "trainer.max_restarts=2",
             "trainer.restart_backoff_s=1", "trainer.state_timeout_s=15",
             "trainer.state_min_tokens_per_s=1e9", "algorithm.filter_groups.enable=true",
             # GDPO on a reward returned as a dict of components: they travel with each
             # sample, through the cached groups of the checkpoints too
             "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,brevity]",
             "algorithm.gdpo_reward_weights=[1.0,0.5]",
             "reward.reward_fn=megarl.reward.testing:scored_in_parts",
             *MOE_R3(tmp_path)]
    proc = megarl("train", _args(quickstart_assets, tmp_path, *extra), start_new_session=True)
    out, code = _kill_a_trainer_worker_after_checkpoints(proc, tmp_path, [2, 4],
                                                          [signal.SIGKILL, signal.SIGSTOP])
    (tmp_path / "run.log").write_text(out)
    assert code == 0, out[-4000:]
    assert re.search(r"run lost \(WorkerLost: .*\); restart 1/2 from the newest checkpoint in 1 s",
                     out), out[-4000:]
    assert re.search(r"run lost \(StateTimeout: [A-Z_]+\(\d+\)@\S+ did not finish within 15 s "
                     r"\(trainer.state_timeout_s = 15 s \+ \d+ tokens at trainer.state_min_tokens"
                     r"_per_s = 1e\+09\): something it waits on is wedged\); restart 2/2 from the "
                     r"newest checkpoint in 2 s", out), out[-4000:]
    saved = [int(s) for s in re.findall(r"resuming after step (\d+) from", out)]
    assert len(saved) == 2 and saved[0] in (2, 4) and saved[1] in (4, 6), out[-4000:]
    state = json.loads((tmp_path / "megarl" / "t" / f"global_step_{saved[0]}" /
                        "driver_state.json").read_text())
    assert state["partial"]["groups"], "the checkpoint should hold cached partial groups"
    # a started cached sample keeps the experts the engine routed its positions to (R3):
    # prompt + its tokens so far, less the last one, which never ran through the model
    started = [t for g in state["partial"]["groups"] for t in g["samples"] if t["ids"]]
    assert started and all(t["routed"]["shape"][1:] == [2, 2] for t in started)
    scored = [t for g in state["partial"]["groups"] for t in g["samples"]
              if t["reward"] is not None]
    assert all(set(t["reward_extra"]) == {"acc", "brevity"} for t in scored)
    assert len(scalars(tmp_path, "gdpo/brevity/mean")) == 8
    assert "cached prompt group(s) restored" in out
    for n, k in enumerate(saved, 1):
        assert f"step {k} restart: restart {n} after: " in out
    assert scalars(tmp_path, "trainer/restarts") == {saved[0] + 1: 1.0, saved[1] + 1: 2.0}
    steps = trained(tmp_path)
    assert sorted(steps) == list(range(8))
    uids = [u for k in range(8) for u in steps[k]]
    assert all(len(steps[k]) == 8 for k in range(8))
    assert len(uids) == len(set(uids)), "a prompt was trained twice"
    dropped = [u for k, us in trained(tmp_path, "filtered").items() for u in us]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(uids)
    counts = scalars(tmp_path, "rollout/filter_groups/filtered_groups")
    assert sorted(counts) == list(range(1, 9)) and sum(counts.values()) == len(dropped)
    final = json.loads((tmp_path / "megarl" / "t" / "global_step_8" /
                        "driver_state.json").read_text())
    cached = {g["uid"] for g in final["partial"]["groups"]}
    assert not cached & set(uids)
    # what the loader handed out, in its seeded order, up to the final position
    loader = fresh_loader(quickstart_assets)
    drawn = set()
    while (loader.state_dict()["epoch"], loader.state_dict()["offset"]) != \
            (final["loader"]["epoch"], final["loader"]["offset"]):
        drawn |= {p.uid for p in loader.next_batch()}
    assert set(uids) | set(dropped) | cached == drawn
    assert scalars(tmp_path, "rollout/partial/ratio")
    # (whether a continued sample also spans two versions depends on how fast generation runs
    # against the syncs: on 2 loaded cores none did; test_sglang_backend_trains_on_stock_servers
    # asserts that span on its 40 steps)
    assert scalars(tmp_path, "rollout/partial/versions_spanned_max")


def test_kl_in_reward_with_adaptive_coefficient(quickstart_assets, tmp_path):
    """PPO-style in-reward KL: the reference model runs for it alone (no KL loss), the
    penalty is logged each step and the adaptive coefficient is checkpointed. ReMax's
    advantages, as verl's remax example trains them (with KL in the reward): one greedy
    baseline response per prompt generated beside the samples, under partial rollout (each
    group's baseline cut off, cached and checkpointed with it). (Also run with each GENERATE
    on one weight version: `trainer.sync_between_generations`.)"""
    extra = ["trainer.total_training_steps=3", "trainer.save_freq=3", "trainer.test_freq=-1",
             "trainer.val_before_train=False", "algorithm.use_kl_in_reward=True",
             "algorithm.kl_penalty=low_var_kl", "algorithm.kl_ctrl.type=adaptive",
             "algorithm.kl_ctrl.target_kl=0.001",
             "algorithm.kl_ctrl.horizon=100", "actor_rollout_ref.actor.use_kl_loss=False",
             "algorithm.max_staleness=1", "trainer.sync_between_generations=true",
             "algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.partial_rollout=True"]
    megarl("train", _args(quickstart_assets, tmp_path, *extra))
    requests = scalars(tmp_path, "rollout/remax/baseline_requests")
    # greedy responses finished per step: the trained groups' (8), maybe some of cached groups
    assert sorted(requests) == [1, 2, 3] and sum(requests.values()) >= 24, requests
    assert len(scalars(tmp_path, "rollout/remax/baseline_reward_mean")) == 3
    assert sum(scalars(tmp_path, "rollout/partial/aborted_requests").values()) > 0
    # sync_between_generations: SYNC(k) starts once GENERATE(k+1) has ended, one step off
    events = [e for e in json.loads((tmp_path / "megarl" / "t" / "timeline.json")
                                    .read_text())["traceEvents"] if e["ph"] == "X"]
    span = {(e["cat"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in events}
    assert all(span[("sync", k)][0] >= span[("generate", k + 1)][1] for k in range(2))
    assert scalars(tmp_path, "rollout/staleness_max") == {1: 0.0, 2: 1.0, 3: 1.0}
    kl = scalars(tmp_path, "reward/kl_penalty")
    assert sorted(kl) == [1, 2, 3]
    assert all(v >= 0 for v in kl.values()) and max(kl.values()) > 0
    assert not scalars(tmp_path, "actor/kl_loss")
    state = json.loads((tmp_path / "megarl" / "t" / "global_step_3" /
                        "driver_state.json").read_text())
    # KL above target grows the coefficient from its initial 0.001
    assert state["kl_coef"] > 0.001
    # each cached group holds its baseline (finished, cut off or not started: which, depends
    # on timing; test_partial_rollout.py cuts one off deterministically), its tokens' versions
    base = [g["baseline"] for g in state["partial"]["groups"]]
    assert base and all(len(b["versions"]) == len(b["ids"]) for b in base)


def test_dual_buffer_synchronous_run_on_two_nodes(quickstart_assets, tmp_path):
    """With the dual buffer a SYNC ends before its transfer lands; GENERATE(k) must still
    start on version k when generate_ahead_steps=1 (it waits for the engines). The layout is
    trainer.nnodes=2 (one Ray node standing in for both): servers bind the node's address,
    not loopback, so trainers on another node could reach them."""
    extra = ["trainer.total_training_steps=5", "trainer.save_freq=-1", "trainer.test_freq=-1",
             "trainer.val_before_train=False", "trainer.generate_ahead_steps=1",
             "actor_rollout_ref.rollout.enable_dual_buffer=True",
             "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    out = megarl("train", _args(quickstart_assets, tmp_path, *extra))
    assert scalars(tmp_path, "rollout/staleness_max") == {k: 0.0 for k in range(1, 6)}
    assert len(scalars(tmp_path, "timing/wait_for_weights_s")) == 5
    line = next(x for x in out.splitlines() if "rollout servers:" in x)
    assert "http://" in line and "127.0.0.1" not in line, line
    assert sorted(trained(tmp_path)) == list(range(5))


def test_logp_on_a_group_of_its_own_matches_logp_beside_the_trainer(quickstart_assets,
                                                                    tmp_path):
    """The seed layout with every task on its own group, spelt as the seed's usage example
    spells it (`+`, `sperated_*`): LOGP(k) runs on a replica of the actor that the weight sync
    feeds, at exactly version k (lag 0), its weights verified against the trainer's after
    every version. The replica has a layout of its own (TP=2 on 2 of 5 CPU devices; the
    trainer is TP=1): the sync's HF-named weights are resharded into it. Its log-probs, and
    so the whole run, equal those of the seed layout where logp shares the trainer's group
    (4 devices), whose trainer runs at CP=2 (each sequence over its two ranks): the weights
    it syncs are verified against the engines' too."""
    common = ["trainer.total_training_steps=3",
              "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
              "+actor_rollout_ref.async_pipeline=True", "+trainer.generate_ahead_steps=2",
              "actor_rollout_ref.rollout.verify_weight_sync=True",
              # without it a SYNC may land mid-GENERATE (dual buffer), at a moment that
              # depends on each layout's timing, and the two runs' samples would differ
              "trainer.sync_between_generations=true"]
    layouts = {
        "own": ["+trainer.sperated_node_tasks=[logp,ref_logp,actor-train,generate]",
                "+trainer.sperated_node_ratios=[0.4,0.2,0.2,0.2]", "trainer.n_gpus_per_node=5",
                "actor_rollout_ref.logp.tensor_model_parallel_size=2"],
        # the trainer's two ranks split each sequence (context parallelism, CP=2: the
        # actor's training and its LOGP pass), where the other layout's one rank holds it
        "shared": ["+trainer.sperated_node_tasks=[[logp,actor-train],ref_logp,generate]",
                   "+trainer.sperated_node_ratios=[0.5,0.25,0.25]", "trainer.n_gpus_per_node=4",
                   "actor_rollout_ref.actor.megatron.context_parallel_size=2"],
    }
    runs, outs = {}, {}
    for name, layout in layouts.items():
        runs[name] = tmp_path / name
        outs[name] = megarl("train", _args(quickstart_assets, runs[name], *common, *layout))
    own = outs["own"]
    assert "logp replica receives weights at http://127.0.0.1:" in own, own[-3000:]
    # versions 1..3 reached the replica and the engine, checksums equal to the trainer's
    assert "logp model: 2 process(es) on group logp" in own, own[-3000:]
    for v in range(1, 4):  # the generate group's engine and one receiver per replica rank
        assert f"weights v{v} stage 0 verified on 3 engine(s)" in own, own[-3000:]
    assert scalars(runs["own"], "actor/logp_version") == {s: s - 1.0 for s in range(1, 4)}
    assert set(scalars(runs["own"], "actor/logp_version_lag").values()) == {0.0}
    # pg_loss is a mean of ratio x advantage terms of size ~1 that nearly cancel (|loss| ~1e-3):
    # the TP=2 replica's log-probs differ from TP=1's in the last float bits (~1e-7 of a term),
    # which is ~1e-7 of the loss absolutely but 5e-5 of it relatively (seen under load)
    for tag, tol in (("reward/mean", 1e-7), ("rollout/logp_mismatch_mean", 1e-7),
                     ("actor/pg_loss", 1e-6)):
        a, b = scalars(runs["own"], tag), scalars(runs["shared"], tag)
        assert sorted(a) == [1, 2, 3], tag
        assert a == pytest.approx(b, rel=1e-5, abs=tol), tag
    # the timeline shows LOGP on its own group, after the SYNC that brought its weights
    events = [e for e in json.loads((runs["own"] / "megarl" / "t" / "timeline.json")
                                    .read_text())["traceEvents"] if e["ph"] == "X"]
    end = {(e["cat"], e["args"]["step"]): e["ts"] + e["dur"] for e in events}
    start = {(e["cat"], e["args"]["step"]): e["ts"] for e in events}
    for k in range(1, 3):
        assert start[("logp", k)] >= end[("sync", k - 1)]


TWO_TURNS = '''
import dataclasses

from megarl.controller.trajectory import StepRollout
from megarl.rollout.protocol import GenerateRequest


async def two_turns(ctx, sampling):
    """A first answer, then a second turn that sees it; the second is trained on."""
    done = []
    for p in ctx.loader.next_batch():
        first = await ctx.runner.sample(p, GenerateRequest(
            p.prompt_ids, dataclasses.replace(sampling, n=1), True, f"s{ctx.step}-{p.uid}-d"))
        base = GenerateRequest(p.prompt_ids + first.ids, sampling, True, f"s{ctx.step}-{p.uid}")
        done += [await ctx.runner.sample(p, r) for r in base.expand()]
    return StepRollout([t.sample for t in done], [t.future for t in done],
                       {"rollout/user/turns": 2.0,
                        "rollout/user/context_len_mean": sum(
                            len(t.sample.prompt_ids) for t in done) / len(done)})
'''


def test_a_rollout_function_by_import_path_drives_generate(quickstart_assets, tmp_path):
    """`actor_rollout_ref.rollout.rollout_fn=file.py:function`: the user's function makes each
    step's samples over the runner; the run trains on them, exactly the loader's prompts."""
    (tmp_path / "user_rollout.py").write_text(TWO_TURNS)
    extra = ["trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
             "trainer.val_before_train=False",
             f"actor_rollout_ref.rollout.rollout_fn={tmp_path}/user_rollout.py:two_turns"]
    megarl("train", _args(quickstart_assets, tmp_path, *extra))
    assert scalars(tmp_path, "rollout/user/turns") == {1: 2.0, 2: 2.0, 3: 2.0}
    ctx = scalars(tmp_path, "rollout/user/context_len_mean")
    loader = fresh_loader(quickstart_assets)
    batches = {k: loader.next_batch() for k in range(3)}
    # the second turn's prompt holds the first answer
    assert all(ctx[k + 1] > max(len(p.prompt_ids) for p in b) for k, b in batches.items())
    assert sorted(scalars(tmp_path, "reward/mean")) == [1, 2, 3]
    assert trained(tmp_path) == {k: sorted(p.uid for p in b) for k, b in batches.items()}
