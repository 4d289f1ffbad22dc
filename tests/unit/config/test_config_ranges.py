"""Value rules: the RANGES table covers every numeric field, bools are strict, and the YAML
structure limits hold exactly at their bounds."""
import typing

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.loader import YAML_LIMITS
from megarl.config.schema import RANGES, Range, leaf_types

A = "actor_rollout_ref"


LEAVES = leaf_types()


def _is_numeric(hint) -> bool:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:
        return any(_is_numeric(a) for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return _is_numeric(args[0])
    return hint in (int, float)


def test_every_numeric_field_has_a_range_and_every_range_a_field():
    numeric = {key for key, hint in LEAVES.items() if _is_numeric(hint)}
    assert numeric - RANGES.keys() == set(), "give these fields a range in schema.RANGES"
    assert RANGES.keys() - numeric == set(), "RANGES names keys the schema does not have"


def test_schema_defaults_are_inside_their_ranges():
    load_config(None, [])  # validation runs the same table over the defaults


@pytest.mark.parametrize("rng, inside, outside, text", [
    (Range(0, low_open=True), [1e-9, 5], [0, -1], "> 0"),
    (Range(0, 1, low_open=True), [1, 0.5], [0, 1.01], "in (0, 1]"),
    (Range(1, also=(-1,)), [-1, 1, 7], [0, -2], "-1 or >= 1"),
    (Range(0, 2**31, high_open=True), [0, 2**31 - 1], [-1, 2**31], "in [0, 2**31)"),
    (Range(), [-1e300, 0], [], "any finite number"),
])
def test_range_allows_and_describes(rng, inside, outside, text):
    assert all(rng.allows(v) for v in inside)
    assert not any(rng.allows(v) for v in outside)
    assert rng.describe() == text


@pytest.mark.parametrize("key", sorted(k for k, h in LEAVES.items() if h is bool))
@pytest.mark.parametrize("value", ["0", "1", "2", "'true'"])
def test_bool_fields_take_only_booleans(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: must be true or false"):
        load_config(None, [f"{key}={value}"])


def test_bool_field_may_be_an_interpolation():
    cfg = load_config(None, ["trainer.val_before_train=true",
                             f"{A}.async_pipeline=${{trainer.val_before_train}}"])
    assert cfg.actor_rollout_ref.async_pipeline is True


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def _nested_override_config(levels: int) -> str:
    """YAML whose deepest collection is ``4 + levels`` deep (root, arr, model, override)."""
    lines = [f"{A}:", "  model:", "    override_config:"]
    lines += ["  " * (3 + i) + f"k{i}:" for i in range(levels)]
    lines[-1] += " 1"  # the last key holds a scalar, not a mapping
    return "\n".join(lines) + "\n"


def test_nesting_at_the_limit_loads_and_one_deeper_is_refused(tmp_path):
    limit = YAML_LIMITS["depth"]
    load_config(write(tmp_path, _nested_override_config(limit - 3)), [])
    with pytest.raises(ConfigError, match=f"nested deeper than {limit} levels"):
        load_config(write(tmp_path, _nested_override_config(limit - 2)), [])


def test_value_length_limit(tmp_path):
    chars = YAML_LIMITS["chars"]
    cfg = load_config(None, ["trainer.experiment_name=" + "x" * chars])
    assert len(cfg.trainer.experiment_name) == chars
    with pytest.raises(ConfigError, match=f"{chars + 1} characters"):
        load_config(None, ["trainer.experiment_name=" + "x" * (chars + 1)])


def test_value_count_limit_counts_aliases_expanded(tmp_path):
    # 30 written values that build ~330 (10 aliases to an 11-node list, 3 times) load; 300
    # written values that build ~3,300, over the limit, do not.
    def text(lists: int) -> str:
        return (f"{A}:\n  model:\n    override_config:\n      a: &a [" + ", ".join(["1"] * 10)
                + "]\n" + "".join(f"      b{i}: [" + ", ".join(["*a"] * 10) + "]\n"
                                   for i in range(lists)))
    assert YAML_LIMITS["values"] < 3_000
    load_config(write(tmp_path, text(3)), [])
    with pytest.raises(ConfigError, match="aliases expanded"):
        load_config(write(tmp_path, text(30)), [])


def test_a_file_value_error_names_the_file_and_an_override_does_not(tmp_path):
    path = write(tmp_path, f"{A}:\n  rollout:\n    top_p: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    assert str(err.value).startswith(f"{A}.rollout.top_p: must be in (0, 1]")
    assert str(err.value).endswith(f" in {path}")
    with pytest.raises(ConfigError) as err:  # the override replaced the file's value
        load_config(path, [f"{A}.rollout.top_p=-1"])
    assert path not in str(err.value)


def test_clip_ratio_above_one_needs_its_own_low_bound():
    with pytest.raises(ConfigError, match=rf"^{A}\.actor\.clip_ratio: .*clip_ratio_low"):
        load_config(None, [f"{A}.actor.clip_ratio=1.5"])
    load_config(None, [f"{A}.actor.clip_ratio=1.5", f"{A}.actor.clip_ratio_low=0.2"])
