"""Fuzz `megarl config`: bad values, bad YAML and bad overrides each get one clear line.

Seeded and bounded: every config case issue 17 lists, then cases drawn with
``random.Random(SEED)``: a schema key × a kind of bad value (wrong type, NaN, inf, out of its
``RANGES`` range, huge int), given as an override or in a YAML file, plus random bytes in and
truncations of the quickstart YAML. Each must exit 2 with a single stderr line that names the
key (and the file), nothing on stdout and no traceback. The CLI runs in-process (fast); a few
cases also run as a subprocess for the real exit status.
"""
from __future__ import annotations

import random
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config.schema import CHOICES, RANGES, leaf_types

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SEED = 17
A = "actor_rollout_ref"


LEAVES = leaf_types()


def _base(hint):
    """``Optional[X]`` -> X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union else hint


def _out_of_range(key: str, is_int: bool) -> list[str]:
    r = RANGES.get(key)
    if r is None:
        return []
    step = 1 if is_int else 0.5
    out = []
    if r.low is not None:
        out.append(r.low if r.low_open else r.low - step)
        if r.also and is_int:
            out.append(-2)
    if r.high is not None:
        out.append(r.high if r.high_open else r.high + step)
    return [repr(v) for v in out if v not in r.also]


def bad_values(key: str, hint) -> list[tuple[str, str]]:
    """(kind, YAML text) pairs that the field ``key`` of type ``hint`` must refuse."""
    base = _base(hint)
    if base is bool:
        return [("int", "2"), ("int0", "0"), ("int1", "1"), ("float", "1.5"),
                ("word", "maybe"), ("list", "[true]"), ("map", "{a: 1}")]
    if base is int:
        return [("word", "abc"), ("float", "1.5"), ("bool", "true"), ("huge", str(2**70)),
                ("list", "[1]"), ("map", "{a: 1}"), ("nan", ".nan"),
                *(("range", v) for v in _out_of_range(key, True))]
    if base is float:
        return [("word", "abc"), ("bool", "true"), ("nan", ".nan"), ("inf", ".inf"),
                ("-inf", "-.inf"), ("list", "[1.0]"), ("map", "{a: 1}"),
                *(("range", v) for v in _out_of_range(key, False))]
    if base == typing.List[float]:
        low = _out_of_range(key, False)
        return [("nan", "[.nan, 0.5]"), ("inf", "[.inf, 0.5]"), ("word", "[abc, 0.5]"),
                ("scalar", "0.5"), ("map", "{a: 1}"),
                *(("range", f"[{v}, 0.5]") for v in low)]
    if base is str:
        extra = [("choice", "bogus_value")] if key in CHOICES else []
        return [("list", "[1, 2]"), ("map", "{a: 1}"), *extra]
    if base == typing.List[str]:
        return [("map", "{a: 1}"), ("scalar", "5")]
    if typing.get_origin(base) is dict:
        return [("list", "[1, 2]"), ("scalar", "5"), ("nan", "{a: .nan}"),
                ("deep-inf", "{a: {b: [.inf]}}")]
    return []  # Any-typed fields (data files, task groups) take many shapes


def _as_yaml(key: str, value_text: str) -> str:
    parts = key.split(".")
    lines = [f"{'  ' * i}{p}:" for i, p in enumerate(parts[:-1])]
    lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {value_text}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the cases
# Each case: (id, overrides, YAML text or bytes or None, substring the message must hold).
# "{file}" in the substring stands for the YAML file's path.

def _alias_bomb(levels: int = 6, width: int = 10) -> str:
    lines = [f"{A}:", "  model:", "    override_config:",
             "      l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"      l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


LISTED = [  # issue 17, `megarl config`: accepted, or a traceback, before
    ("async_pipeline=2", [f"{A}.async_pipeline=2"], None, f"{A}.async_pipeline"),
    ("total_training_steps=-5", ["trainer.total_training_steps=-5"], None,
     "trainer.total_training_steps"),
    ("total_training_steps=0", ["trainer.total_training_steps=0"], None,
     "trainer.total_training_steps"),
    ("lr=-0.001", [f"{A}.actor.optim.lr=-0.001"], None, f"{A}.actor.optim.lr"),
    ("lr=.nan", [f"{A}.actor.optim.lr=.nan"], None, f"{A}.actor.optim.lr"),
    ("temperature=-1", [f"{A}.rollout.temperature=-1"], None, f"{A}.rollout.temperature"),
    ("top_p=0", [f"{A}.rollout.top_p=0"], None, f"{A}.rollout.top_p"),
    ("top_k=0", [f"{A}.rollout.top_k=0"], None, f"{A}.rollout.top_k"),
    ("reward.timeout_s=0", ["reward.timeout_s=0"], None, "reward.timeout_s"),
    ("clip_ratio=-0.2", [f"{A}.actor.clip_ratio=-0.2"], None, f"{A}.actor.clip_ratio"),
    ("kl_ctrl.horizon=0", ["algorithm.kl_ctrl.horizon=0"], None, "algorithm.kl_ctrl.horizon"),
    ("seed=2**70", [f"trainer.seed={2**70}"], None, "trainer.seed"),
    ("seed=2**40", [f"trainer.seed={2**40}"], None, "trainer.seed"),
    ("ratios=[nan,nan]", ["trainer.separated_node_ratios=[.nan,.nan]"], None,
     "trainer.separated_node_ratios"),
    ("ratios=[nan,1.0]", ["trainer.separated_node_ratios=[.nan,1.0]"], None,
     "trainer.separated_node_ratios"),
    ("yaml-not-utf8", [], b"trainer:\n  project_name: caf\xe9\n", "{file}"),
    ("yaml-deep-flow", [], f"{A}:\n  model:\n    override_config:\n      a: "
     + "[" * 100_000 + "]" * 100_000 + "\n", "{file}"),
    ("yaml-deep-block", [], f"{A}:\n  model:\n    override_config:\n"
     + "".join("  " * (3 + i) + f"k{i}:\n" for i in range(200)) + "  " * 203 + "v: 1\n",
     "{file}"),
    ("yaml-alias-bomb", [], _alias_bomb(), "{file}"),
]

MALFORMED = [  # overrides and YAML a new user might type
    ("no-equals", ["trainer"], None, "'trainer'"),
    ("no-key", ["=3"], None, "'=3'"),
    ("only-plus", ["+"], None, "'+'"),
    ("empty", [""], None, "override"),
    ("delete", ["~trainer.seed"], None, "~trainer.seed"),
    ("double-dot", ["trainer..nnodes=1"], None, "trainer..nnodes"),
    ("value-as-section", ["trainer.nnodes.x=1"], None, "trainer.nnodes.x"),
    ("unclosed-list", ["trainer.nnodes=[1,"], None, "trainer.nnodes"),
    ("unclosed-map", ["trainer.nnodes={"], None, "trainer.nnodes"),
    ("python-tag", ["trainer.seed=!!python/object/apply:os.system [ls]"], None, "trainer.seed"),
    ("nul-in-value", ["trainer.experiment_name=a\x00b"], None, "trainer.experiment_name"),
    ("5000-digits", ["trainer.nnodes=" + "9" * 5000], None, "trainer.nnodes"),
    ("deep-override", [f"{A}.model.override_config.a=" + "[" * 50_000], None,
     f"{A}.model.override_config.a"),
    ("missing-marker", ["trainer.seed=???"], None, "trainer.seed"),
    ("long-list-for-str", ["trainer.experiment_name=[" + ",".join(["abcdef"] * 400) + "]"],
     None, "trainer.experiment_name"),
    ("bad-interpolation", ["trainer.seed=${nope.nothing}"], None, "trainer.seed"),
    ("alias-key-nan", ["trainer.sperated_node_ratios=[.nan]"], None,
     "trainer.separated_node_ratios"),
    ("betas-one", [f"{A}.actor.optim.betas=[0.9]"], None, f"{A}.actor.optim.betas"),
    ("yaml-list-top", [], "- 1\n- 2\n", "{file}"),
    ("yaml-tab", [], "trainer:\n\tnnodes: 1\n", "{file}"),
    ("yaml-two-docs", [], "trainer: {nnodes: 1}\n---\ntrainer: {nnodes: 2}\n", "{file}"),
    ("yaml-undefined-alias", [], "trainer:\n  nnodes: *x\n", "{file}"),
    ("yaml-unhashable-key", [], "? [a, b]\n: 1\n", "{file}"),
    ("yaml-bool-as-int", [], "data:\n  shuffle: 1\n", "data.shuffle"),
    ("yaml-nul", [], "trainer:\n  nnodes: 1\x00\n", "{file}"),
    ("yaml-too-big", [], "trainer:\n  experiment_name: x\n" + "#" * (1 << 20) + "\n", "{file}"),
    ("yaml-date-in-open-dict", [], f"{A}:\n  model:\n    override_config:\n      d: 2024-01-01\n",
     f"{A}.model.override_config"),
    ("yaml-set-in-open-dict", [], f"{A}:\n  model:\n    override_config: !!set {{a, b}}\n",
     f"{A}.model.override_config"),
]


def _generated_values(rng: random.Random, count: int) -> list:
    pairs = [(key, kind, text) for key, hint in sorted(LEAVES.items())
             for kind, text in bad_values(key, hint)]
    cases, seen = [], set()
    for key, kind, text in rng.sample(pairs, count):
        how = "override" if rng.random() < 0.5 else "yaml"
        name = f"{key}={kind}:{how}"
        if name in seen:  # a key can have two bad values of one kind (below, above range)
            name += f"#{len(cases)}"
        seen.add(name)
        if how == "override":
            cases.append((name, [f"{key}={text}"], None, key))
        else:
            cases.append((name, [], _as_yaml(key, text), key))
    return cases


_CONTROL = [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F]
_NOT_UTF8 = [*range(0x80, 0xC0), 0xC0, 0xC1, *range(0xF5, 0x100)]


def _generated_bytes(rng: random.Random, count: int) -> list:
    """Bytes YAML never accepts (a lone invalid UTF-8 byte, a control character) at random
    places in the quickstart file, and whole files of random bytes."""
    text = QUICKSTART.read_bytes()
    cases = []
    for i in range(count):
        pos = rng.randrange(len(text))
        bad = bytes([rng.choice(_NOT_UTF8 if i % 2 else _CONTROL)])
        cases.append((f"bytes-{i}@{pos}", [], text[:pos] + bad + text[pos:], "{file}"))
    for i in range(3):
        cases.append((f"random-file-{i}", [], bytes(rng.randrange(256) for _ in range(300)),
                      "{file}"))
    return cases


def _generated_truncations(rng: random.Random, count: int) -> list:
    """The quickstart file cut inside a key (a key with no ':' is never valid YAML) or
    inside a flow list."""
    text = QUICKSTART.read_text()
    cuts, offset = [], 0
    for line in text.splitlines(keepends=True):
        name = line.split("#")[0].strip().partition(":")[0]
        if name and ":" in line and not line.lstrip().startswith("#"):
            start = offset + line.index(name)
            cuts.extend(range(start + 1, start + len(name)))
        if "[[" in line:
            cuts.append(offset + line.index("[[") + 5)
        offset += len(line)
    return [(f"truncated@{cut}", [], text[:cut], "{file}") for cut in rng.sample(cuts, count)]


_RNG = random.Random(SEED)
CASES = (LISTED + MALFORMED + _generated_values(_RNG, 140) + _generated_bytes(_RNG, 14)
         + _generated_truncations(_RNG, 12))


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(["config", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clear_error(code: int, out: str, err: str, expected: str) -> None:
    assert code == 2, f"exit {code}; stderr: {err[:300]!r}"
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, f"not one line: {err[:500]!r}"
    assert lines[0].startswith("megarl config: ") and expected in lines[0], lines[0]
    assert len(lines[0]) < 400, lines[0]


@pytest.mark.parametrize("case_id, overrides, yaml_text, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(case_id, overrides, yaml_text, expected, tmp_path,
                                       capsys):
    argv = list(overrides)
    if yaml_text is not None:
        path = tmp_path / "cfg.yaml"
        if isinstance(yaml_text, bytes):
            path.write_bytes(yaml_text)
        else:
            path.write_text(yaml_text, encoding="utf-8")
        argv = ["--config", str(path), *argv]
        expected = expected.replace("{file}", str(path))
    start = time.perf_counter()
    code, out, err = run_cli(capsys, argv)
    elapsed = time.perf_counter() - start
    assert_clear_error(code, out, err, expected)
    if yaml_text is not None and expected != str(path):
        assert str(path) in err  # a value error from a file names the file too
    assert elapsed < 10, f"took {elapsed:.2f} s"  # a bound, not a benchmark: CI is shared


def test_case_count_and_listed_cases_present():
    assert len(CASES) >= 200
    assert len({c[0] for c in CASES}) == len(CASES)


def test_alias_bomb_is_refused_fast(tmp_path, capsys):
    run_cli(capsys, [])  # imports done before the clock starts
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(levels=9, width=10))  # 10**9 values if it were built
    start = time.perf_counter()
    code, out, err = run_cli(capsys, ["--config", str(path)])
    assert time.perf_counter() - start < 1.0
    assert_clear_error(code, out, err, str(path))
    assert "aliases" in err


@pytest.mark.parametrize("argv, yaml_bytes, expected", [
    ([f"{A}.async_pipeline=2"], None, f"{A}.async_pipeline"),
    (["trainer.separated_node_ratios=[.nan,1.0]"], None, "trainer.separated_node_ratios"),
    ([], _alias_bomb().encode(), "aliases"),
    ([], b"trainer:\n  project_name: caf\xe9\n", "not UTF-8"),
], ids=["bool-int", "nan-ratio", "alias-bomb", "not-utf8"])
def test_subprocess_exit_status(argv, yaml_bytes, expected, tmp_path):
    if yaml_bytes is not None:
        path = tmp_path / "cfg.yaml"
        path.write_bytes(yaml_bytes)
        argv = ["--config", str(path), *argv]
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "config", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert_clear_error(proc.returncode, proc.stdout, proc.stderr, expected)


# ------------------------------------------------------------------ what must still load

@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_still_load(path, capsys):
    code, out, err = run_cli(capsys, ["--config", str(path)])
    assert code == 0, err
    assert "trainer:" in out


@pytest.mark.parametrize("override", [
    f"{A}.rollout.top_k=-1", f"{A}.rollout.top_k=1", f"{A}.rollout.temperature=0",
    f"{A}.rollout.top_p=1", f"{A}.actor.optim.lr=0", f"{A}.actor.optim.clip_grad=0",
    f"trainer.seed={2**31 - 1}", "trainer.seed=0", "trainer.test_freq=-1",
    "trainer.save_freq=1", "trainer.total_training_steps=null", "trainer.total_training_steps=1",
    f"{A}.actor.clip_ratio_low=1.0", f"{A}.actor.tis_imp_ratio_cap=null", "algorithm.gamma=0",
    f"{A}.rollout.over_sample_prompts=0", "reward.failure_score=-1.5",
    f"{A}.model.override_config.rope_scaling={{type: linear, factor: 2.0}}",
    "trainer.val_only=false", f"{A}.async_pipeline=${{trainer.val_only}}",
])
def test_boundary_values_load(override, capsys):
    code, _, err = run_cli(capsys, [override])
    assert code == 0, err


def test_date_for_a_string_field_is_the_string(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer:\n  experiment_name: 2024-01-01\n")
    code, out, err = run_cli(capsys, ["--config", str(path)])
    assert code == 0, err
    assert "experiment_name: '2024-01-01'" in out


def test_modest_anchors_and_aliases_load(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(_alias_bomb(levels=2, width=10))  # 1,000 values: fine
    code, out, err = run_cli(capsys, ["--config", str(path)])
    assert code == 0, err
