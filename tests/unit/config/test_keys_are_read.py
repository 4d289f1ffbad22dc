"""Every config key does something: a key the schema accepts is read by the code that runs,
or is one of the few listed here with what it does instead. A key that validates and is then
never read (data.val_batch_size was one) tells a user their setting took effect when it did
not.

The check is by name: a leaf key's last part must be read (``.name`` or ``"name"``) by a
module of the run, outside the config package's own checking and the dry run's planning.
"""
from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from megarl.config import schema

PACKAGE = Path(__file__).resolve().parents[3] / "megarl"
# The config's own checking and documentation, and planning: reading a key there is not
# acting on it in a run.
NOT_THE_RUN = {"config/schema.py", "config/validate.py", "config/reference.py",
               "config/loader.py", "config/preflight.py", "controller/dryrun.py",
               "controller/memory.py"}
# Keys a run does not read, and why that is their whole meaning.
NOT_READ_BY_A_RUN = {
    # verl's keys naming the training backend; megatron is their only allowed value (CHOICES)
    "actor_rollout_ref.actor.strategy": "one value: megatron",
    "critic.strategy": "one value: megatron",
    # planning only: preflight refuses them in a run (test_preflight.py)
    "actor_rollout_ref.model.override_config": "--dry-run only",
    "actor_rollout_ref.model.hf_config_path": "--dry-run only",
    # verl's key; verl 0.9.1 ignores it too: megarl keeps every row's raw chat (schema.py)
    "data.return_raw_chat": "accepted for verl's scripts, no effect",
}


def leaf_keys() -> list[str]:
    out = []

    def walk(node, prefix):
        for k in node.keys():
            child = node._get_node(k)
            key = f"{prefix}{k}"
            if OmegaConf.is_dict(child) and child._metadata.object_type not in (None, dict):
                walk(child, key + ".")
            else:
                out.append(key)
    walk(OmegaConf.structured(schema.MegaRLConfig), "")
    return out


def _run_sources() -> str:
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
                     if str(p.relative_to(PACKAGE)) not in NOT_THE_RUN)


def unread(keys, source: str) -> list[str]:
    def read(name):
        return re.search(r"(\.%s\b|[\"']%s[\"'])" % (name, name), source)
    return [k for k in keys if not read(k.rsplit(".", 1)[1])]


def test_the_check_finds_a_key_no_run_code_reads():
    assert unread(["data.val_batch_size", "data.seed"], "x = cfg.data.seed\n") == \
        ["data.val_batch_size"]


def test_every_key_is_read_by_the_run_or_says_why_not():
    keys = leaf_keys()
    assert len(keys) > 150 and "data.val_batch_size" in keys
    missing = sorted(set(unread(keys, _run_sources())) - set(NOT_READ_BY_A_RUN))
    assert not missing, f"schema keys no run code reads: {missing}"
    # and the list holds no key that is gone or has become read
    assert set(NOT_READ_BY_A_RUN) <= set(keys)
    assert sorted(unread(NOT_READ_BY_A_RUN, _run_sources())) == sorted(NOT_READ_BY_A_RUN)
