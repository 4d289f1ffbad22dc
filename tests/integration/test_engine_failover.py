"""Engines that die or wedge mid-generation: the rollout manager over real server processes.

Each engine is `python -m megarl.rollout.server` (SGLang's contract) in its own process, killed
with SIGKILL (dead) or stopped with SIGSTOP (wedged: the socket accepts, nothing answers).
The requests on it must finish on the other engine with exactly the tokens an undisturbed
engine gives (greedy, same weights), a replacement must stay out of rotation until it serves
the live engines' weight version, and with no engine left the error names each one.
"""
import asyncio
import os
import signal

import pytest

from megarl.backends.sglang.engine import SGLangEngine
from megarl.backends.sglang.launcher import ServerArgs, find_free_port, launch_server
from megarl.rollout.manager import NoEngineLeft, RolloutManager
from megarl.rollout.protocol import GenerateRequest, SamplingParams

# Long enough that every request is still generating when its engine is killed, however fast
# the machine (an unloaded CI runner finishes 48 tokens in well under the kill's latency).
LENGTH = 512


def _server(model, tmp_path, version="3"):
    args = ServerArgs(model_path=str(model), port=find_free_port(), load_format="auto",
                      weight_version=version, random_seed=0, log_level="warning",
                      extra_args=["--sglang-contract"])
    return launch_server(args, module="megarl.rollout.server", timeout_s=300,
                         log_path=tmp_path / f"server-{args.port}.log")


@pytest.fixture
def servers(qwen_dir, tmp_path):
    started = []

    def start(version="3"):
        started.append(_server(qwen_dir, tmp_path, version))
        return started[-1]
    yield start
    for s in started:
        try:
            os.kill(s.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        s.stop()


def _requests(tag):
    sp = SamplingParams(max_new_tokens=LENGTH, temperature=0.0, ignore_eos=True)
    return [GenerateRequest([11 + i, 7, 5 + i], sp, True, f"{tag}-{i}") for i in range(8)]


async def _reference(url):
    """What one undisturbed engine answers to every request."""
    m = RolloutManager([SGLangEngine(url)])
    try:
        return {o.rid: o.output_ids for o in await asyncio.gather(
            *[m.generate(r) for r in _requests("ref")])}
    finally:
        await m.close()


async def _kill_when_busy(manager, i, sig, proc):
    while manager.load()[i] == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # tokens are being produced on it
    assert manager.load()[i] > 0, "its requests finished before the kill: raise LENGTH"
    os.kill(proc.pid, sig)


def test_a_killed_engine_is_replaced_and_its_requests_finish_elsewhere(servers):
    a, b = servers(), servers()
    spare = []

    async def replace(i):
        spare.append(await asyncio.to_thread(servers, "0"))  # fresh weights report v0
        return SGLangEngine(spare[-1].url)

    async def go():
        ref = await _reference(b.url)
        # a generous health deadline: a loaded machine must not fail the replacement's checks
        m = RolloutManager([SGLangEngine(a.url), SGLangEngine(b.url)], replace=replace,
                           health_interval_s=0.2, health_timeout_s=30.0)
        try:
            assert await m.weight_versions() == ["3", "3"]
            reqs = _requests("ref")
            killer = asyncio.ensure_future(_kill_when_busy(m, 0, signal.SIGKILL, a.proc))
            outs = await asyncio.gather(*[m.generate(r) for r in reqs])
            await killer
            during = m.pop_metrics()
            while 0 in m._replacing:  # the replacement server is still starting
                await asyncio.sleep(0.1)
            # v0 weights: not routed to while the live engine serves v3
            assert m.joining == {0}, (m.dead, m.events)
            assert await m.weight_versions() == ["3"]
            again = await asyncio.gather(*[m.generate(r) for r in _requests("again")])
            assert all(o.weight_version_spans[0][0] == "3" for o in again)
            # the next weight sync reaches it: live again
            await m.engines[0].client.update_weight_version("3")
            assert sorted(await m.weight_versions()) == ["3", "3"] and m.joining == set()
            after = m.pop_metrics()
            return ref, outs, during, after
        finally:
            await m.close()

    ref, outs, during, after = asyncio.run(go())
    assert {o.rid: o.output_ids for o in outs} == ref
    assert all(len(o.output_ids) == LENGTH for o in outs)
    assert during["rollout/engine_failures"] == 1 and during["rollout/requeued_requests"] >= 1
    assert during["rollout/engines_alive_min"] == 1
    assert after["rollout/engines_alive"] == 2
    # counted when it came back, which on an idle machine can be before the requests ended
    assert during["rollout/engines_replaced"] + after["rollout/engines_replaced"] == 1
    assert len(spare) == 1


def test_a_replacement_that_dies_starting_is_tried_again(servers):
    """The only engine is killed mid-request; its first replacement dies while starting (the
    callback raises, as `RolloutGroup.restart` does for an actor killed before it answers),
    the second comes up: the request finishes on it, two restarts counted."""
    a, spare = servers(), servers()
    tries = []

    async def replace(i):
        tries.append(i)
        if len(tries) == 1:
            raise RuntimeError("the actor died unexpectedly before finishing this task")
        return SGLangEngine(spare.url)

    async def go():
        ref = await _reference(spare.url)
        m = RolloutManager([SGLangEngine(a.url)], replace=replace, health_interval_s=0.2,
                           health_timeout_s=30.0)
        try:
            await m.weight_versions()
            killer = asyncio.ensure_future(_kill_when_busy(m, 0, signal.SIGKILL, a.proc))
            outs = await asyncio.gather(*[m.generate(r) for r in _requests("ref")])
            await killer
            return ref, outs, list(m.restarts), [w for _, _, w in m.pop_events()]
        finally:
            await m.close()

    ref, outs, restarts, events = asyncio.run(go())
    assert {o.rid: o.output_ids for o in outs} == ref
    assert tries == [0, 0] and restarts == [2]
    assert events == ["dead", "replaced", "live"], events


def test_a_wedged_engine_fails_its_health_check_and_loses_nothing(servers):
    a, b = servers(), servers()

    async def go():
        ref = await _reference(b.url)
        m = RolloutManager([SGLangEngine(a.url), SGLangEngine(b.url)],
                           health_interval_s=0.2, health_timeout_s=1.0)
        try:
            stopper = asyncio.ensure_future(_kill_when_busy(m, 0, signal.SIGSTOP, a.proc))
            outs = await asyncio.wait_for(
                asyncio.gather(*[m.generate(r) for r in _requests("ref")]), 60)
            await stopper
            return ref, outs, dict(m.dead), m.pop_metrics()
        finally:
            await m.close()

    ref, outs, dead, metrics = asyncio.run(go())
    assert {o.rid: o.output_ids for o in outs} == ref
    assert list(dead) == [0] and "health check" in dead[0]
    assert metrics["rollout/engines_alive"] == 1


def test_with_no_engine_left_the_error_names_each_engine(servers):
    a = servers()

    async def go():
        m = RolloutManager([SGLangEngine(a.url)], health_interval_s=0.2, health_timeout_s=1.0)
        try:
            killer = asyncio.ensure_future(_kill_when_busy(m, 0, signal.SIGKILL, a.proc))
            with pytest.raises(NoEngineLeft) as e:
                await asyncio.gather(*[m.generate(r) for r in _requests("x")])
            await killer
            return str(e.value)
        finally:
            await m.close()

    msg = asyncio.run(go())
    assert a.url in msg and "dead" in msg


# ---------------------------------------------------------------- whole runs
def _wait_trained(run_dir, steps, proc, timeout=300):
    import time

    f = run_dir / "megarl" / "t" / "trained_prompts.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if f.exists() and len(f.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not train {steps} steps (exit {proc.poll()})")


def _engine_processes(root_pid, marker):
    import psutil

    # Ray's raylet (and so its workers) descend from the driver it was started by.
    procs = psutil.Process(root_pid).children(recursive=True)
    out = []
    for p in procs:
        try:
            cmd = p.cmdline()
            if (marker == "server" and cmd[1:3] == ["-m", "sglang.launch_server"]) or (
                    marker == "ray" and "ray::RolloutActor" in " ".join(cmd)):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _server_groups(root_pid):
    """The process groups of the run's launched servers and of their group guards."""
    import psutil

    groups = {os.getpgid(p.pid) for p in _engine_processes(root_pid, "server")}
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if any(a.endswith("group_guard.py") for a in p.cmdline()):
                groups.add(os.getpgid(p.pid))
        except (psutil.Error, ProcessLookupError):
            pass
    return groups


def _survivors(groups, within_s):
    """The live processes of `groups` once `within_s` has passed or none is left."""
    import time

    import psutil

    deadline = time.monotonic() + within_s
    while True:
        left = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            try:
                if os.getpgid(p.pid) in groups and p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, " ".join(p.info["cmdline"] or [])[:120]))
            except (psutil.Error, ProcessLookupError):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _check_recovered(run_dir, out, assets, engines):
    """The steps the run logged before it was stopped: contiguous from step 1, each trained
    exactly the prompts an undisturbed run draws, and the last one served by every engine.
    Returns how many steps that was."""
    import re

    from test_train_e2e import fresh_loader, scalars, trained

    logged = sorted(scalars(run_dir, "reward/mean"))
    steps = len(logged)
    assert logged == list(range(1, steps + 1)), out[-3000:]
    # none lost, none twice (a step trained just before the stop may not be logged yet)
    loader = fresh_loader(assets)
    want = {k: sorted(p.uid for p in loader.next_batch()) for k in range(steps)}
    assert {k: v for k, v in trained(run_dir).items() if k < steps} == want
    alive = scalars(run_dir, "rollout/engines_alive")
    low = scalars(run_dir, "rollout/engines_alive_min")
    assert min(low.values()) == engines - 1, low  # the dip ...
    assert alive[steps] == engines, alive  # ... and the recovery
    assert sum(scalars(run_dir, "rollout/engines_replaced").values()) == 1
    # the trainer counts the dead engine as stale (if a sync found it dead) until its slot
    # has the replacement
    stale = scalars(run_dir, "weight_sync/stale_engines")
    assert max(stale.values()) <= 1 and stale[steps] == 0, stale
    # the replacement had the newest weights out of band, checksums equal to the trainer's,
    # before any sync reached it (the next sync sends a newer version) ...
    ((slot, url),) = re.findall(r"rollout engine (\d+) restarted at (\S+)", out)
    refit = re.search(rf"engine slot {slot} refit to weights v(\d+) out of band", out)
    assert refit, out[-3000:]
    assert f"weights v{refit[1]} stage 0 on {url}: " in out, out[-3000:]
    # ... then took part in the weight syncs and serves the version the others serve
    assert "replaces" in out and "is live again at weight version" in out, out[-3000:]
    # the state machine's record of it: the failure and the recovery, under GENERATE
    assert "generate: rollout engine" in out and "): dead" in out and "): live" in out
    return steps


# The run is long enough never to end by itself: how long a replacement takes (a new process
# loading the model) depends on the machine's load, so the test waits for the recovery, lets
# a few more steps train on both engines, then stops the run with SIGINT.
STEPS = 1000
AFTER = 3
LONGER = "data.max_response_length=24"


def _sigint_default():
    """In the child before exec: SIGINT back to its default. A shell without job control
    starts background commands (CI's, say) with SIGINT ignored, and Python then never turns
    it into KeyboardInterrupt: the stop below would go unheard."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _trained_count(run_dir):
    f = run_dir / "megarl" / "t" / "trained_prompts.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def _kill_one_and_finish(proc, run_dir, assets, marker, engines):
    """Once step 0 has trained, SIGKILL one of the run's engines; wait for its replacement
    to go live and AFTER more steps to train, stop the run, check (see _check_recovered)."""
    import threading
    import time

    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_trained(run_dir, 1, proc)
        victims = _engine_processes(proc.pid, marker)
        assert len(victims) == engines, victims
        groups = _server_groups(proc.pid) if marker == "server" else set()
        victims[0].kill()
        deadline = time.time() + 400
        while (time.time() < deadline and proc.poll() is None
               and not any("is live again at weight version" in x for x in lines)):
            time.sleep(0.05)
        assert proc.poll() is None, "".join(lines)[-4000:]
        _wait_trained(run_dir, _trained_count(run_dir) + AFTER, proc)
        if marker == "server":  # the replacement's too
            groups |= _server_groups(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=30)
    out = "".join(lines)
    (run_dir / "run.log").write_text(out)
    if marker == "ray":  # `megarl train` itself: interrupted, said so in one line
        assert proc.returncode == 130 and "Traceback" not in out, out[-4000:]
        assert "interrupted; a later `megarl train`" in out
    assert _check_recovered(run_dir, out, assets, engines) >= AFTER
    # nothing of any server outlives the run: the killed one's children, the replacement
    # (stopped by its rank as the rank leaves; SIGTERM alone may leave stock SGLang draining
    # for ever) and their group guards
    if marker == "server":  # each server's group and its guard's, found
        assert len(groups) == 2 * (engines + 1), groups
    left = _survivors(groups, within_s=30)
    assert not left, left


RUN = ("trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
       f"trainer.total_training_steps={STEPS}", "actor_rollout_ref.rollout.verify_weight_sync=True",
       "actor_rollout_ref.rollout.engine_health_interval_s=0.5", LONGER)


def test_ray_run_replaces_its_only_engine_killed(quickstart_assets, tmp_path):
    """One embedded engine under Ray, on-policy (generate_ahead_steps=1: no SYNC comes until
    the step's samples are made), SIGKILLed after step 1, whether mid-generation or while
    the trainer works: its replacement gets the newest weights out of band and the run goes
    on. Before that, the run waited out the manager's join timeout and stopped."""
    from test_train_e2e import _args, megarl

    proc = megarl("train", _args(quickstart_assets, tmp_path, *RUN, "trainer.n_gpus_per_node=2",
                                 "trainer.generate_ahead_steps=1"),
                  start_new_session=True, preexec_fn=_sigint_default)
    _kill_one_and_finish(proc, tmp_path, quickstart_assets, "ray", engines=1)


@pytest.mark.stock_sglang
def test_torchrun_run_replaces_a_killed_stock_sglang_server(quickstart_assets, tmp_path,
                                                           stock_python):
    """`rollout.name=sglang` under torchrun (no Ray), one-step-off with the dual buffer: the
    run's only launched stock SGLang server is SIGKILLed after step 1; its rank starts a new
    one, which gets the newest weights out of band from the trainer's snapshot, and no
    prompt is lost or trained twice. No process of either server's group (or of their group
    guards) outlives the run."""
    import subprocess
    import sys

    from test_train_e2e import _args

    from launch_helpers import CONTROL_SECRET, ROOT

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **CONTROL_SECRET)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "megarl.cli", "train", *_args(
               quickstart_assets, tmp_path, *RUN, "trainer.launcher=torchrun",
               "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.enable_dual_buffer=True",
               "trainer.logger=[console,tensorboard]",
               "actor_rollout_ref.rollout.name=sglang")]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_sigint_default)
    _kill_one_and_finish(proc, tmp_path, quickstart_assets, "server", engines=1)
