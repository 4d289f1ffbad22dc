"""The `megarl` CLI: config printing, exit status 2 on bad config, lazy controller."""
import subprocess
import sys
from pathlib import Path

import yaml

from megarl.cli import main

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "--config", QUICKSTART, "+trainer.generate_ahead_steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["generate_ahead_steps"] == 3
    # max_new_tokens is filled from data.max_response_length when the YAML leaves it null
    assert printed["actor_rollout_ref"]["rollout"]["max_new_tokens"] == \
        printed["data"]["max_response_length"] == 8


def test_bad_override_exits_2_naming_key(capsys):
    assert main(["config", "--config", QUICKSTART, "trainer.test_frq=2"]) == 2
    err = capsys.readouterr().err
    assert "trainer.test_frq" in err and "did you mean `trainer.test_freq`?" in err
    assert "Traceback" not in err


def test_config_paths_that_are_not_files_say_what_they_are(capsys, tmp_path):
    """A directory is not 'not found'; a missing file is."""
    for path, said in [(tmp_path, f"{tmp_path}: is a directory, not a config file"),
                       (tmp_path / "nope.yaml", f"config file not found: {tmp_path}/nope.yaml")]:
        assert main(["train", "--config", str(path)]) == 2
        assert said in capsys.readouterr().err


def test_subprocess_exit_status_and_stderr():
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "config", "trainer.nnodes=abc"],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "trainer.nnodes" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_train_without_controller_exits_2(capsys, monkeypatch):
    # Hide the driver whether or not it exists yet: None in sys.modules fails the import.
    monkeypatch.setitem(sys.modules, "megarl.controller.driver", None)
    assert main(["train", "--config", QUICKSTART]) == 2
    assert "megarl train: the controller is not built yet" in capsys.readouterr().err


def test_validate_calls_driver_in_val_only_mode(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("megarl.controller.driver")
    fake.run = lambda cfg, val_only=False: calls.append((cfg, val_only))
    monkeypatch.setitem(sys.modules, "megarl.controller.driver", fake)
    assert main(["validate", "--config", QUICKSTART]) == 0
    (cfg, val_only), = calls
    assert val_only is True and cfg.trainer.val_only is True


def test_validate_without_val_files_is_a_config_error(capsys):
    assert main(["validate", "data.val_files=null"]) == 2
    assert "trainer.val_only" in capsys.readouterr().err
