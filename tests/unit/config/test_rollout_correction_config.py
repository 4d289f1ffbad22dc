"""``algorithm.rollout_correction``: verl's keys and defaults, errors by key before any work,
megarl's TIS keys as the alias of a plain ``rollout_is``, and the settings reaching the
actor's loss."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from megarl.config import ConfigError, load_config
from tests.verl_reference import ROOT, VERL_REF

RC = "algorithm.rollout_correction"
A = "actor_rollout_ref.actor"
CAP, LEVEL = f"{A}.tis_imp_ratio_cap", f"{A}.tis_level"
VERL_YAML = VERL_REF / "verl" / "trainer" / "config" / "_generated_ppo_megatron_trainer.yaml"


def test_keys_and_defaults_are_those_of_verls_trainer_yaml():
    """Every key of verl 0.9.1's section, with the value its trainer config gives it (its
    RolloutCorrectionConfig dataclass says rollout_is: sequence, but a run reads the YAML,
    where it is null: off)."""
    if not VERL_YAML.is_file():
        pytest.fail(f"verl 0.9.1's reference is not installed ({VERL_YAML}): run "
                    "`bash tools/setup_verl_ref.sh`")
    theirs = yaml.safe_load(VERL_YAML.read_text())["algorithm"]["rollout_correction"]
    theirs = {k: v for k, v in theirs.items() if not k.startswith("_")}
    mine = dict(load_config(None, []).algorithm.rollout_correction)
    assert mine == theirs
    assert mine["rollout_is"] is None and mine["bypass_mode"] is False


def test_a_default_config_does_not_load_torch():
    """At verl's defaults the section is not parsed, so loading a config stays torch-free."""
    code = ("import sys\nfrom megarl.config import load_config\nload_config(None, [])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("overrides, key, text", [
    ([f"{RC}.rollout_is=tok"], f"{RC}.rollout_is", "did you mean `token`"),
    ([f"{RC}.rollout_is_threshold=abc"], f"{RC}.rollout_is_threshold", "not a number"),
    ([f"{RC}.rollout_is_threshold='2.0_0.5'"], f"{RC}.rollout_is_threshold", "lower bound"),
    ([f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize",
     "rollout_is is null"),
    ([f"{RC}.rollout_rs=seq_max_k1", f"{RC}.rollout_rs_threshold=2"], f"{RC}.rollout_rs",
     "unknown option 'seq_max_k1'"),
    ([f"{RC}.rollout_rs=token_k1"], f"{RC}.rollout_rs_threshold", "required"),
    ([f"{RC}.rollout_rs_threshold=0.5"], f"{RC}.rollout_rs_threshold", "rollout_rs is null"),
    ([f"{RC}.rollout_rs=seq_sum_k3", f"{RC}.rollout_rs_threshold='0.1_2.0'"],
     f"{RC}.rollout_rs_threshold", "one upper bound"),
    ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type", "bypass_mode is false"),
    ([f"{RC}.loss_type=pg"], f"{RC}.loss_type", "not one of ppo_clip, reinforce"),
    ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token",
      f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize",
     "one micro-batch at a time"),
    ([f"{RC}.bypass_mode=true", f"{A}.policy_loss.loss_mode=cispo"], f"{RC}.bypass_mode",
     "loss_mode is cispo"),
    (["trainer.n_gpus_per_node=2", "trainer.separated_node_tasks=[[generate,ref_logp,"
      "actor-train],[logp]]", "trainer.separated_node_ratios=[0.5,0.5]",
      f"{RC}.bypass_mode=true"], f"{RC}.bypass_mode", "skips the LOGP pass"),
    # the alias: megarl's keys given beside rollout_is must say the same
    ([f"{RC}.rollout_is=sequence", f"{LEVEL}=token"], LEVEL,
     f"and {RC}.rollout_is: sequence set the same importance weight differently"),
    ([f"{RC}.rollout_is=token", f"{CAP}=3"], CAP,
     f"and {RC}.rollout_is_threshold: 2.0 set the same"),
    ([f"{RC}.rollout_is=token", f"{CAP}=null"], CAP, "set the same importance weight"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='0.5_2.0'", f"{CAP}=2"], CAP,
     "asks for one it cannot say"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true", f"{LEVEL}=token"],
     LEVEL, "asks for one it cannot say"),
    ([f"{RC}.bypass_mode=true", f"{LEVEL}=sequence"], LEVEL, "does nothing under"),
])
def test_errors_name_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert msg.startswith(f"{key}: "), msg
    assert text in msg, msg


def test_a_plain_rollout_is_sets_megarls_keys_and_agreeing_ones_may_be_given(tmp_path):
    cfg = load_config(None, [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=3"])
    assert (cfg.actor_rollout_ref.actor.tis_level, cfg.actor_rollout_ref.actor.tis_imp_ratio_cap) \
        == ("sequence", 3.0)
    # given in the file, agreeing: fine; a number-like string threshold is a number
    f = tmp_path / "c.yaml"
    f.write_text(f"algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                 f"    rollout_is_threshold: '1.5'\nactor_rollout_ref:\n  actor:\n"
                 f"    tis_level: token\n    tis_imp_ratio_cap: 1.5\n")
    cfg = load_config(str(f), [])
    assert cfg.actor_rollout_ref.actor.tis_imp_ratio_cap == 1.5
    with pytest.raises(ConfigError, match=rf"^{CAP}: 2.0 and {RC}.rollout_is_threshold"):
        load_config(str(f), [f"{CAP}=2"])  # the override disagrees with the file's threshold
    # IcePop or normalised: megarl's keys (at their defaults) are not touched, and unused
    cfg = load_config(None, [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold='0.5_5.0'"])
    assert cfg.actor_rollout_ref.actor.tis_level == "token"
    # rollout_is null: megarl's keys govern, as they always did
    cfg = load_config(None, [f"{CAP}=4", f"{RC}.rollout_rs=token_k1",
                             f"{RC}.rollout_rs_threshold='0.5_2.0'"])
    assert cfg.actor_rollout_ref.actor.tis_imp_ratio_cap == 4.0
    assert cfg.algorithm.rollout_correction.rollout_is is None


def test_the_settings_reach_the_actors_loss():
    from megarl.algo.rollout_correction import RolloutCorrection, RSCheck
    from megarl.cluster.spec import megatron_spec

    cfg = load_config(None, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='0.5_5.0'",
                             f"{RC}.rollout_is_batch_normalize=true",
                             f"{RC}.rollout_rs='token_k1,seq_mean_k3'",
                             f"{RC}.rollout_rs_threshold='0.6_1.6,0.2'"])
    rc = megatron_spec(cfg, "actor").actor_loss.rollout_correction
    assert rc == RolloutCorrection("token", 5.0, 0.5, True,
                                   (RSCheck("token_k1", 1.6, 0.6), RSCheck("seq_mean_k3", 0.2)))
    assert rc.weights_from_batch and rc.plain_tis is None
    cfg = load_config(None, [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce"])
    rc = megatron_spec(cfg, "actor").actor_loss.rollout_correction
    assert rc.bypass_mode and rc.loss_type == "reinforce" and not rc.weights_from_batch
