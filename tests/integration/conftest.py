"""Runs shared by several integration modules (each `megarl train` costs tens of seconds)."""
from pathlib import Path

import pytest
from test_train_e2e import _args, megarl

from megarl.controller import checkpoint as ckpt


@pytest.fixture(scope="session")
def undamaged(quickstart_assets, tmp_path_factory) -> Path:
    """The run directory of one finished 4-step quickstart run saving every 2 steps (the
    arguments test_checkpoint_fallback.py's EXTRA and test_checkpoint_naming_e2e.py's resume with):
    global_step_2 and global_step_4, named by completed steps as verl's. Read it, or copy it
    to change it."""
    run = tmp_path_factory.mktemp("undamaged")
    megarl("train", _args(quickstart_assets, run, "trainer.total_training_steps=4",
                          "trainer.save_freq=2", "trainer.test_freq=-1",
                          "trainer.val_before_train=False"))
    assert ckpt.steps(run / "megarl" / "t") == [4, 2]
    return run
