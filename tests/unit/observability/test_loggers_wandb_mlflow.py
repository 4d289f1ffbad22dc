"""W&B and MLflow sinks through their real libraries, read back from what they stored (W&B's
offline run file, MLflow's SQLite store); validation generations in every sink and the JSONL;
verl's per-source validation metrics, against verl 0.9.1's own code."""
import json
import logging
import sys

import pytest

from megarl.config import ConfigError, load_config
from megarl.controller.batch import Sample
from megarl.observability.loggers import check_installed, make_loggers
from megarl.observability.tracking import STEP_KEY, mlflow_metric_name
from megarl.observability.val_report import (generation_rows, per_source_metrics,
                                             validation_metrics)
from tracking_readers import mlflow_json_artifact, mlflow_run, wandb_offline_runs
from verl_reference import verl_run

CONFIG = {"trainer": {"project_name": "proj", "logger": ["wandb", "mlflow"]},
          "actor_rollout_ref": {"actor": {"optim": {"lr": 0.003}},
                                "rollout": {"api_key": "s3cret-token", "n": 4}}}
ROWS = [{"data_source": "gsm8k", "prompt": "What is 1 + 2?", "response": "3 | done\nok",
         "score": 1.0},
        {"data_source": "math", "prompt": "What is 2 + 2?", "response": "5", "score": 0.0}]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline into tmp, never online; MLflow on its default store (the run directory)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    # W&B's own start-up deadlines (its service process, then init) are short for a loaded
    # 2-core machine: one run of the fast tier beside multi-rank tests failed once here
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "300")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")
    (tmp_path / "wandb_dir").mkdir()
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_wandb_offline_run_reads_back(offline):
    with make_loggers(["wandb"], offline / "run", project="proj", experiment="exp",
                      config=CONFIG) as loggers:
        for step in (1, 2, 3):
            loggers.log(step, {"reward/mean": step / 10, "timing/generate": 2.0 * step,
                               "flag": True, "name": "not a number"})
        # a validation of version 2 scored after step 3 was logged: kept, at step 2
        loggers.log(2, {"val-core/gsm8k/acc/mean@1": 0.5})
    import wandb

    wandb.teardown()  # the service process ends, having written everything it was sent
    (run,) = wandb_offline_runs(offline / "wandb_dir")
    assert (run.project, run.name) == ("proj", "exp")
    rollout = run.config["actor_rollout_ref"].pop("rollout")
    assert rollout == {"api_key": "<redacted>", "n": 4}  # the rollout token stays here
    assert run.config == {**CONFIG, "actor_rollout_ref": {"actor": {"optim": {"lr": 0.003}}}}
    assert not any(b"s3cret" in f.read_bytes()
                   for f in (offline / "wandb_dir").rglob("*") if f.is_file())
    assert run.metric("reward/mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert run.metric("timing/generate") == pytest.approx({1: 2.0, 2: 4.0, 3: 6.0})
    assert run.metric("val-core/gsm8k/acc/mean@1") == {2: 0.5}
    assert not any("flag" in row or "name" in row for row in run.history)
    assert not (offline / "run" / "wandb").exists()  # WANDB_DIR wins over the run directory


def test_mlflow_run_reads_back_from_the_tracking_uri(offline, monkeypatch):
    uri = f"sqlite:///{offline / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with make_loggers(["mlflow"], offline / "run", project="proj", experiment="exp",
                      config=CONFIG) as loggers:
        for step in (1, 2, 3):
            loggers.log(step, {"reward/mean": step / 10, "flag": True})
        loggers.log(2, {"val-core/gsm8k/acc/mean@1": 0.5, "val-aux/a:b/c d/x": 1.0})
    assert not (offline / "run" / "mlflow.db").exists()
    client, run = mlflow_run(uri, "proj", "exp")
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == pytest.approx([(1, 0.1), (2, 0.2), (3, 0.3)])
    assert run.data.metrics["val-core/gsm8k/acc/mean_at_1"] == 0.5  # verl's name for it
    assert run.data.metrics["val-aux/a:b/c d/x"] == 1.0  # valid as it is
    assert "flag" not in run.data.metrics
    assert run.data.params["actor_rollout_ref/actor/optim/lr"] == "0.003"
    assert run.data.params["trainer/logger"] == '["wandb", "mlflow"]'
    assert run.data.params["actor_rollout_ref/rollout/api_key"] == "<redacted>"
    assert b"s3cret" not in (offline / "elsewhere.db").read_bytes()


@pytest.mark.parametrize("name, expected", [
    ("reward/mean", "reward/mean"),
    ("val-core/openai/gsm8k/acc/best@4/mean", "val-core/openai/gsm8k/acc/best_at_4/mean"),
    ("perf/idle_ratio/trainer:0", "perf/idle_ratio/trainer:0"),
    ("val-aux/math (level 5)/acc/mean@1", "val-aux/math _level 5_/acc/mean_at_1"),
    ("val-core//x/", "val-core/x"),
    ("val-core/../acc", "val-core/__/acc"),
    ("/lead/./dot", "lead/_/dot"),
    ("données/é", "données/é"),
])
def test_mlflow_metric_names_are_valid_and_deterministic(name, expected):
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_metric_name(name) == expected
    _validate_metric_name(expected)  # MLflow's own check passes
    assert mlflow_metric_name(expected) == expected


def test_val_generations_reach_every_sink_and_the_jsonl(offline, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    caplog.set_level(logging.INFO, logger="megarl.progress")
    run_dir = offline / "run"
    with make_loggers(["console", "tensorboard", "wandb", "mlflow"], run_dir, project="proj",
                      experiment="exp", config=CONFIG) as loggers:
        loggers.log(2, {"val/reward_mean": 0.5})
        loggers.log_generations(2, ROWS)
        loggers.log_generations(4, ROWS[:1])
        loggers.log_generations(5, [])  # nothing to show: nothing written
    jsonl = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text()
             .splitlines()]
    assert jsonl == [{"step": 2, **ROWS[0]}, {"step": 2, **ROWS[1]}, {"step": 4, **ROWS[0]}]
    shown = [m for m in caplog.messages if m.startswith("validation generation")]
    assert len(shown) == 3 and "at step 2 (gsm8k): score=1 prompt='What is 1 + 2?'" in shown[0]
    # TensorBoard: a text summary per validation
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode()
             for e in acc.Tensors("val/generations/text_summary")}
    assert sorted(texts) == [2, 4]
    assert "1 + 2" in texts[2] and "2 + 2" in texts[2] and "2 + 2" not in texts[4]
    # W&B: a wandb.Table per validation, in the offline run's files
    (run,) = wandb_offline_runs(offline / "wandb_dir")
    tables = {row[STEP_KEY]: row for row in run.history if "val/generations/path" in row}
    assert sorted(tables) == [2, 4] and tables[2]["val/generations/_type"] == "table-file"
    table = json.loads((run.dir / "files" / tables[2]["val/generations/path"]).read_text())
    assert table["columns"] == ["step", "data_source", "prompt", "response", "score"]
    assert table["data"] == [[2, *r.values()] for r in ROWS]
    # MLflow: a JSON artifact per validation, in the run directory's own store
    client, mrun = mlflow_run(f"sqlite:///{run_dir / 'mlflow.db'}", "proj", "exp")
    assert mlflow_json_artifact(client, mrun.info.run_id, "val_generations/step_2.json") == \
        [{"step": 2, **r} for r in ROWS]
    assert (run_dir / "mlartifacts").is_dir()


def _sample(uid, source, reward, score=None, n_tokens=3, finish="stop"):
    s = Sample(uid=uid, prompt_ids=[1, 2], response_ids=list(range(n_tokens)),
               rollout_logprobs=[0.0] * n_tokens, weight_version=0,
               token_versions=[0] * n_tokens, finish=finish, data_source=source,
               response_text=f"r-{uid}")
    s.reward, s.score = reward, reward if score is None else score
    return s


def test_per_source_metrics_of_a_two_source_validation():
    """Greedy (n=1): each source's mean over its prompts, core on acc, reward aux; with
    the overlong penalty logged, its vars aux."""
    samples = [_sample("g1", "gsm8k", 1.0), _sample("g2", "gsm8k", 0.0),
               _sample("g3", "gsm8k", 0.9, score=1.0, finish="length"),
               _sample("m1", "math", 0.5), _sample("m2", "math", 0.0)]
    rewards = [s.reward for s in samples]
    m = validation_metrics(samples, rewards, log_overlong=True)
    assert m["val/reward_mean"] == pytest.approx(2.4 / 5)
    assert m["val/exact_frac"] == pytest.approx(1 / 5)
    assert m["val/eos_frac"] == pytest.approx(4 / 5)
    assert m["val-core/gsm8k/acc/mean@1"] == pytest.approx(2 / 3)
    assert m["val-aux/gsm8k/reward/mean@1"] == pytest.approx(1.9 / 3)
    assert m["val-aux/gsm8k/overlong_reward/mean@1"] == pytest.approx(-0.1 / 3)
    assert m["val-aux/gsm8k/overlong/mean@1"] == pytest.approx(1 / 3)
    assert m["val-core/math/acc/mean@1"] == pytest.approx(0.25)
    assert m["val-aux/math/reward/mean@1"] == pytest.approx(0.25)
    assert {k for k in m if k.startswith("val-")} == {
        f"{sec}/{src}/{var}/mean@1" for src in ("gsm8k", "math")
        for sec, var in (("val-core", "acc"), ("val-aux", "reward"),
                         ("val-aux", "overlong_reward"), ("val-aux", "overlong"))}
    assert not any("overlong" in k for k in validation_metrics(samples, rewards))
    # a reward dict's other numbers: a variable each, when every response has it
    for i, s in enumerate(samples):
        s.reward_extra = {"fmt": float(i), **({"pred": 1.0} if i else {})}
    m = validation_metrics(samples, rewards)
    assert m["val-aux/math/fmt/mean@1"] == pytest.approx(3.5)
    assert not any("/pred/" in k for k in m)


def test_per_source_metrics_equal_verls():
    """verl 0.9.1's process_validation_metrics and the naming of RayPPOTrainer.
    _val_metrics_update (its source, run as it is), on n = 1, 3, 4 and 5 samples per prompt,
    two or three sources, values that tie and values missing (None)."""
    import random

    rnd = random.Random(0)
    cases = {}
    for n in (1, 3, 4, 5):
        src, uid, reward, acc, flag = [], [], [], [], []
        for p in range(7):
            for _ in range(n):
                src.append(("gsm8k", "math", "openai/x")[p % (3 if n > 1 else 2)])
                uid.append(f"p{p}")
                reward.append(rnd.choice([0.0, 0.5, 1.0, rnd.random()]))
                acc.append(None if p == 6 else float(rnd.random() < 0.5))
                flag.append(rnd.random() < 0.3)
        cases[n] = {"src": src, "uid": uid,
                    "infos": {"reward": reward, "acc": acc, "overlong": flag}}
    cases["no-acc"] = {"src": cases[3]["src"], "uid": cases[3]["uid"],
                       "infos": {"reward": cases[3]["infos"]["reward"]}}
    verl = verl_run('''
        import ast, textwrap
        import numpy as np
        import verl.trainer.ppo.metric_utils as mu
        path = mu.__file__.replace("metric_utils.py", "ray_trainer.py")
        src = open(path).read()
        fn = next(n for n in ast.walk(ast.parse(src))
                  if isinstance(n, ast.FunctionDef) and n.name == "_val_metrics_update")
        ns = {"np": np, "process_validation_metrics": mu.process_validation_metrics}
        exec(textwrap.dedent(ast.get_source_segment(src, fn)), ns)
        for name, c in inputs.items():
            m = ns["_val_metrics_update"](None, np.array(c["src"], dtype=object), c["uid"],
                                          c["infos"], [])
            outputs[name] = {k: float(v) for k, v in m.items()}
    ''', cases)
    for name, c in cases.items():
        ours = per_source_metrics(c["src"], c["uid"], c["infos"])
        assert ours.keys() == verl[name].keys(), name
        assert ours == pytest.approx(verl[name], abs=1e-12), name
    assert "val-core/math/acc/best@4/mean" in verl[4] and "val-aux/math/acc/best@2/mean" in verl[4]
    assert "val-core/math/reward/mean@3" in verl["no-acc"]


def test_generation_rows_are_the_first_n_decoded(qwen_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    samples = [_sample(f"p{i}", "gsm8k", float(i)) for i in range(4)]
    for i, s in enumerate(samples):
        s.prompt_ids = tok.encode(f"What is {i} + {i}?")
    rows = generation_rows(samples, [s.reward for s in samples], tok, 2)
    assert rows == [{"data_source": "gsm8k", "prompt": f"What is {i} + {i}?",
                     "response": f"r-p{i}", "score": float(i)} for i in range(2)]
    assert generation_rows(samples, [0.0] * 4, tok, 10) == generation_rows(
        samples, [0.0] * 4, tok, 4)


def test_a_missing_library_fails_at_the_config_check(monkeypatch):
    """As when the package is not installed: Python's import system treats a None entry in
    sys.modules as a module that cannot be imported."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"^trainer\.logger: `wandb` needs the Python package "
                                          r"wandb, not installed here: pip install wandb"):
        load_config(None, ["trainer.logger=[console,wandb]"])
    load_config(None, ["trainer.logger=[console,mlflow]"])
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match=r"`mlflow` needs the Python package sqlalchemy.*"
                                          r"pip install mlflow-skinny sqlalchemy alembic"):
        check_installed(["mlflow"])
    # a tracking server keeps the SQL store on its side
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    check_installed(["mlflow"])
    with pytest.raises(ConfigError, match=r"trainer\.logger: unknown logger 'swanlab'"):
        load_config(None, ["trainer.logger=[console,swanlab]"])


def test_log_val_generations_is_checked():
    assert load_config(None, []).trainer.log_val_generations == 0
    with pytest.raises(ConfigError, match=r"trainer\.log_val_generations"):
        load_config(None, ["trainer.log_val_generations=-1"])
