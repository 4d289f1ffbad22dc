"""`launch/torchrun.sh` without Ray: two "nodes" on loopback, each one torchrun process.

Node 0 (rank 0) runs the driver and the actor + reference model; node 1 (rank 1) serves the
rollout engine. Real torchrun agents, a real TCPStore control plane, real Megatron and a real
gloo weight-sync group; no Ray is started.
"""
import json
import os
import re
import subprocess
import sys
import time
import psutil
import pytest

from launch_helpers import CONTROL_SECRET, ROOT

SCRIPT = ROOT / "launch" / "torchrun.sh"


def _overrides(assets, run_dir, steps):
    return [f"actor_rollout_ref.model.path={assets / 'tiny'}",
            f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=t",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.val_before_train=False", "trainer.save_freq=-1",
            "trainer.logger=[console,tensorboard]",
            # One device per node: the actor, logp and reference share node 0, generate node 1.
            "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
            "trainer.separated_node_ratios=[0.5,0.5]"]


def _launch(assets, run_dir, steps, port, **env_extra):
    """Start both nodes; each in its own session so every process it spawns can be found."""
    procs = []
    for node in (0, 1):
        env = dict(os.environ, NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), NPROC_PER_NODE="1", OMP_NUM_THREADS="1",
                   PYTHON=sys.executable, **CONTROL_SECRET, **env_extra)
        log = open(run_dir / f"node{node}.log", "w")
        procs.append(subprocess.Popen(
            ["bash", str(SCRIPT), str(ROOT / "configs" / "quickstart.yaml"),
             *_overrides(assets, run_dir, steps)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir, start_new_session=True))
        log.close()
    return procs


def _logs(run_dir):
    return [(run_dir / f"node{n}.log").read_text() for n in (0, 1)]


def _tree(p) -> set:
    """The process and all its descendants now (torchrun puts each worker in a session of its
    own, so the launcher's process group alone would miss them)."""
    try:
        root = psutil.Process(p.pid)
        return {root, *root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _wait(procs, timeout, seen: set):
    """Exit codes (None for a node still running at the deadline); `seen` collects every
    process of the nodes' trees met on the way, to check afterwards that none outlived them."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        for p in procs:
            seen |= _tree(p)
        time.sleep(0.2)
    return [p.poll() for p in procs]


def _alive(processes) -> list:
    """Those still running; a zombie (dead, its killed parent never reaped it) is not."""
    out = []
    for q in processes:
        try:
            if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(processes) -> None:
    for q in processes:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "megarl" / "t" / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def _trained_steps(run_dir):
    f = run_dir / "megarl" / "t" / "trained_prompts.jsonl"
    return sorted({json.loads(line)["step"] for line in f.read_text().splitlines()})


# Any ray.init would try to join this address and fail: proof that Ray plays no part.
NO_RAY = {"RAY_ADDRESS": "127.0.0.1:9"}


def _ray_not_installed(where) -> dict:
    """Environment in which `import ray` fails, as on a machine without Ray (a GPU box that
    has only PyTorch): a `sitecustomize` on PYTHONPATH refuses the module to every process."""
    where.mkdir()
    (where / "sitecustomize.py").write_text(
        "import sys\n\n\n"
        "class _NoRay:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden by the test)')\n"
        "\n\n"
        "sys.meta_path.insert(0, _NoRay())\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(where),
                                                         os.environ.get("PYTHONPATH")]))}


def test_ray_hidden_from_python_cannot_be_imported(tmp_path):
    """The hiding itself works (else the test below would prove nothing)."""
    env = dict(os.environ, **_ray_not_installed(tmp_path / "no-ray"))
    p = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "hidden by the test" in p.stderr, p.stderr


def test_two_nodes_on_loopback_train_two_steps(quickstart_assets, tmp_path):
    """... on machines where Ray is not installed at all."""
    from megarl.utils.launch import free_port

    env = {**NO_RAY, **_ray_not_installed(tmp_path / "no-ray")}
    procs, seen = _launch(quickstart_assets, tmp_path, 2, free_port(), **env), set()
    codes = _wait(procs, 180, seen)
    node0, node1 = _logs(tmp_path)
    # Both torchrun trees ended on their own: no agent or worker left behind.
    lingering = _alive(seen)
    _kill(lingering)
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0\n{node0[-4000:]}\n" \
                            f"--- node 1\n{node1[-4000:]}"
    assert len(seen) >= 4, seen  # two agents and two workers were watched
    assert not lingering, f"{lingering} outlived their torchrun"
    # Ranks map to task groups in device order: rank 0 = node 0 = actor+ref, rank 1 = engine.
    assert re.search(r"actor model: 1 process\(es\) on group \S+ \(devices \[0\]\)", node0)
    assert re.search(r"ref model: 1 process\(es\) on group \S+ \(devices \[0\]\)", node0)
    assert "rank 1/2 serving" in node1 and "embedded engine" in node1
    assert "embedded engine" not in node0
    assert _trained_steps(tmp_path) == [0, 1]
    # The engine on node 1 received both trained versions over the weight-sync group, and
    # step 2 trained on samples generated under version 1 (one-step-off), not version 0.
    assert "weights updated: 26 tensors, version 0 -> 1" in node1
    assert "weights updated: 26 tensors, version 1 -> 2" in node1
    assert sorted(_scalars(tmp_path, "weight_sync/time_s")) == [1, 2]
    assert _scalars(tmp_path, "rollout/staleness_max") == {1: 0.0, 2: 1.0}


def test_a_lost_node_ends_the_run_instead_of_hanging(quickstart_assets, tmp_path):
    """Kill node 1 (agent and engine) mid-run: node 0's driver must fail and exit, not wait
    for ever on a rank that is gone (the heartbeat notices within seconds here)."""
    from megarl.utils.launch import free_port

    procs = _launch(quickstart_assets, tmp_path, 200, free_port(),
                    MEGARL_TORCHRUN_HEARTBEAT_S="3", **NO_RAY)
    log0, seen = tmp_path / "node0.log", set()
    deadline = time.time() + 120
    while "step 1/200" not in log0.read_text() and time.time() < deadline \
            and procs[0].poll() is None:
        seen |= _tree(procs[0]) | _tree(procs[1])
        time.sleep(0.1)
    assert "step 1/200" in log0.read_text(), log0.read_text()[-4000:]
    _kill(_tree(procs[1]))
    codes = _wait(procs[:1], 90, seen)
    node0 = log0.read_text()
    lingering = _alive(seen)
    _kill(lingering)
    assert codes[0] not in (None, 0), f"node 0 exit code {codes[0]}\n{node0[-4000:]}"
    assert "step 200/200" not in node0
    assert not lingering, f"{lingering} outlived their torchrun"


def test_bad_launch_settings_fail_before_any_work(tmp_path, monkeypatch):
    from megarl.cluster.torchrun import Control
    from megarl.config import ConfigError, load_config

    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), ["trainer.launcher=torchrun"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR.*launch/torchrun.sh"):
        Control(cfg)  # not started by torchrun
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    with pytest.raises(ConfigError, match=r"trainer.nnodes × trainer.n_gpus_per_node = 1 × 2 "
                                          r"but torchrun started WORLD_SIZE=3"):
        Control(cfg)
    # The script checks its own arguments before starting torchrun.
    env = dict(os.environ, NNODES="2", NODE_RANK="2", PYTHON=sys.executable)
    p = subprocess.run(["bash", str(SCRIPT), str(ROOT / "configs" / "quickstart.yaml")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "NODE_RANK=2 but NNODES=2" in p.stderr
    p = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "missing.yaml")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "missing.yaml not found" in p.stderr
    # several nodes must share the secret their ranks sign commands with: none is made up
    env = {k: v for k, v in env.items() if k != "MEGARL_CONTROL_SECRET"}
    p = subprocess.run(["bash", str(SCRIPT), str(ROOT / "configs" / "quickstart.yaml")],
                       env=dict(env, NODE_RANK="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "MEGARL_CONTROL_SECRET is not set; a job of 2 nodes" in p.stderr


def test_sglang_backend_under_torchrun(quickstart_assets, tmp_path):
    """`rollout.name=sglang` without Ray: the first rank of the rollout replica launches the
    server (here megarl's embedded server in SGLang-contract mode, TP 2 over ranks 2-3), the
    trainer's update group counts its two TP ranks, and the run trains."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **CONTROL_SECRET)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "-m", "megarl.cli", "train", "--config", str(ROOT / "configs" / "quickstart.yaml"),
           *_overrides(quickstart_assets, tmp_path, 3)[:-2], "trainer.launcher=torchrun",
           "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.name=sglang",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
           "actor_rollout_ref.rollout.server_module=megarl.rollout.server",
           "actor_rollout_ref.rollout.server_extra_args=[--sglang-contract]"]
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "(sglang)" in out and "world 3, rank offsets [1]" in out
    assert _trained_steps(tmp_path) == [0, 1, 2]
    assert (tmp_path / "megarl" / "t" / "logs" / "rollout-0.log").exists()


# ------------------------------------------------------------------ restarts (one node)
def _restarting(assets, run_dir, steps, port, max_restarts):
    """`launch/torchrun.sh` on one node, three ranks: the driver and DP rank 0 of the
    trainer (rank 0), the trainer's DP rank 1 (rank 1), the engine (rank 2); a checkpoint
    every two steps; `trainer.max_restarts` as given (the script hands it to torchrun)."""
    env = dict(os.environ, NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), NPROC_PER_NODE="3", OMP_NUM_THREADS="1",
               PYTHON=sys.executable, **NO_RAY)
    overrides = _overrides(assets, run_dir, steps)[:-2] + [
        "trainer.save_freq=2", f"trainer.max_restarts={max_restarts}",
        "trainer.restart_backoff_s=1",
        "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
        "trainer.separated_node_ratios=[0.6666666666666666,0.3333333333333333]"]
    log = open(run_dir / "node0.log", "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), str(ROOT / "configs" / "quickstart.yaml"),
                             *overrides], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=run_dir, start_new_session=True)
    log.close()
    return proc


def _kill_rank(proc, rank: int, life: int, when, timeout=240) -> int:
    """SIGKILL torchrun's rank `rank` of life `life` once `when()` holds; its pid."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if when():
            for q in _tree(proc):
                try:
                    env = q.environ()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if env.get("RANK") == str(rank) and \
                        env.get("TORCHELASTIC_RESTART_COUNT") == str(life):
                    q.kill()
                    return q.pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} of life {life} was never there to kill "
                         f"(exit {proc.poll()})")


def test_a_trainer_rank_killed_twice_restarts_the_run_which_trains_exactly(quickstart_assets,
                                                                           tmp_path):
    """trainer.max_restarts=2 under torchrun: a trainer rank (not the driver's) SIGKILLed
    after the checkpoint of step 2 and again after that of step 4. Each time torchrun's agent
    restarts the node's processes (new processes resuming, as a run killed as a whole and
    started again by hand does) and the run resumes from its newest checkpoint; it finishes
    by itself, each step's batch the one an uninterrupted run draws, each restart saying
    which rank was lost (its host and pid), the saves overlapping generation."""
    from megarl.utils.launch import free_port

    from test_train_e2e import check_saves_overlap_generation, fresh_loader, trained

    proc = _restarting(quickstart_assets, tmp_path, 8, free_port(), 2)
    latest = tmp_path / "megarl" / "t" / "latest_checkpointed_iteration.txt"
    pids = [_kill_rank(proc, 1, life, lambda: latest.exists() and
                       int(latest.read_text()) >= 2 * (life + 1)) for life in (0, 1)]
    code = proc.wait(timeout=300)
    log = (tmp_path / "node0.log").read_text()
    assert code == 0, log[-5000:]
    for n, pid in enumerate(pids, 1):
        assert re.search(rf"run lost \(no word from rank 1 \(host 127\.0\.0\.1, pid {pid}\): "
                         rf"killed, or its host lost\); restart {n}/2 from the newest "
                         rf"checkpoint in {n} s", log), log[-5000:]
        assert f"rank 1/3 serving (node 127.0.0.1, life {n})" in log
    assert re.findall(r"resuming after step (\d+) from", log) == ["2", "4"], log[-5000:]
    assert _scalars(tmp_path, "trainer/restarts") == {3: 1.0, 5: 2.0}
    steps = trained(tmp_path)
    loader = fresh_loader(quickstart_assets)
    assert sorted(steps) == list(range(8))
    for k in range(8):  # the last record of each step: what the final weights trained on
        assert steps[k] == sorted(p.uid for p in loader.next_batch()), k
    run = tmp_path / "megarl" / "t"
    # named by completed steps, as verl: global_step_2, _4, _6, _8; the last life from _4 on
    assert sorted(int(p.name.split("_")[-1]) for p in run.glob("global_step_*")) == [2, 4, 6, 8]
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "8"
    check_saves_overlap_generation(tmp_path, 4, 8, save_freq=2)
    # one timeline across the lives: the earlier lives' work kept ahead on the wall clock
    # (what was trained again marked lost), each restart an incident on it
    events = json.loads((run / "timeline.json").read_text())["traceEvents"]
    earlier = [e for e in events if e["ph"] == "X" and e["args"].get("earlier")]
    trained_before = {e["args"]["step"] for e in earlier if e["cat"] == "actor-train"}
    assert {0, 1, 2, 3} <= trained_before, sorted(trained_before)
    assert max(e["ts"] for e in earlier) < 0 < max(e["ts"] for e in events if e["ph"] == "X")
    assert all(e["args"].get("lost") for e in earlier if e["args"]["step"] >= 4)
    restarts = [e["args"]["what"] for e in events if e["ph"] == "i"]
    assert len(restarts) == 2 and all(w.startswith("restart ") for w in restarts), restarts


def test_a_third_loss_past_max_restarts_2_stops_naming_all_three(quickstart_assets, tmp_path):
    """The same rank SIGKILLed three times with trainer.max_restarts=2 (the first time once a
    step has trained, then each restart as its driver begins to set up again): the agent
    gives up and the last life's driver names every loss, in order."""
    from megarl.utils.launch import free_port

    proc = _restarting(quickstart_assets, tmp_path, 40, free_port(), 2)
    log = tmp_path / "node0.log"
    pids = [_kill_rank(proc, 1, 0, lambda: "step 1/40" in log.read_text())]
    for life in (1, 2):
        # once the life's driver has taken up the restart (every rank checked in)
        pids.append(_kill_rank(proc, 1, life, lambda: f"restart {life}/2 from the newest "
                                                      "checkpoint" in log.read_text()))
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert code not in (None, 0), text[-4000:]
    lost = [f"({n}) no word from rank 1 (host 127.0.0.1, pid {pid}): killed, or its host lost"
            for n, pid in enumerate(pids, 1)]
    assert "the run was lost 3 times, past trainer.max_restarts=2: " + "; ".join(lost) in text, \
        text[-4000:]
    assert "step 40/40" not in text
