"""docs/config_reference.md is generated from the schema and must not go stale."""
from pathlib import Path

from megarl.config.reference import field_docs, render

DOC = Path(__file__).resolve().parents[3] / "docs" / "config_reference.md"


def test_reference_is_up_to_date():
    assert DOC.read_text() == render(), "run: python tools/gen_config_reference.py"


def test_every_leaf_key_is_documented():
    text = render()
    rows = [l for l in text.splitlines() if l.startswith("| `")]
    assert any("`trainer.separated_node_ratios`" in r for r in rows)
    assert any("`actor_rollout_ref.rollout.param_update_consume_bucket_size_mb`" in r
               for r in rows)
    undocumented = [r.split("|")[1] for r in rows if r.rstrip().endswith("|  |")]
    assert not undocumented, undocumented
    assert field_docs()["TrainerConfig"]["generate_ahead_steps"]
