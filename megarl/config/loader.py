"""Load a megarl config: schema defaults < YAML file < command-line overrides.

This module owns how text becomes a config: reading the YAML file, parsing Hydra-style
``key=value`` / ``+key=value`` / ``++key=value`` overrides (values parsed as YAML), the
aliases (``sperated_*``, and verl's names for megarl keys), and the unknown-key and type
errors (with a did-you-mean). verl's keys that megarl has not are set aside for
``verl_keys.apply`` (noted, refused, or mapped onto megarl's keys). It then fills derived
defaults and calls ``validate_config``. There is no Hydra: no config groups,
no ``defaults`` list, no ``~key`` deletion; one YAML file and a flat list of overrides.

YAML is untrusted text: before any of it is built into objects, its event stream is scanned
against ``YAML_LIMITS`` (file size, nesting depth, values with aliases expanded, value length),
so an alias bomb or a 100k-deep nesting is refused in well under a second instead of hanging or
overflowing the stack.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Iterator, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config import verl_keys
from megarl.config.device import announce, resolve_device
from megarl.config.errors import ConfigError
from megarl.config.schema import MegaRLConfig, leaf_types
from megarl.config.validate import (plan_task_groups, show, update_group_backend,
                                    validate_config)

# The feature request that started the project spelled these "sperated"; both spellings work.
# verl's keys that are a megarl key under another name come from its table (verl_keys.tsv).
ALIASES = {
    "trainer.sperated_node_tasks": "trainer.separated_node_tasks",
    "trainer.sperated_node_ratios": "trainer.separated_node_ratios",
    **verl_keys.ALIASES,
}


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` as a float (YAML 1.1 wants ``1.0e-6``)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _schema_paths(cls: type, prefix: str = "") -> tuple[set[str], set[str], set[str]]:
    """(sections, leaves, open leaves) of a dataclass schema as dotted paths.

    An open leaf is a dict-typed field (``model.override_config``) that takes any sub-key.
    """
    sections, leaves, open_leaves = set(), set(), set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, hint = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            sections.add(path)
            sub = _schema_paths(hint, path + ".")
            sections |= sub[0]
            leaves |= sub[1]
            open_leaves |= sub[2]
        else:
            leaves.add(path)
            if typing.get_origin(hint) is dict:
                open_leaves.add(path)
    return sections, leaves, open_leaves


_SECTIONS, _LEAVES, _OPEN_LEAVES = _schema_paths(MegaRLConfig)
_ALL_PATHS = sorted(_SECTIONS | _LEAVES)
# What "did you mean" may offer: megarl's keys and verl's (a typo of a verl key is told the key)
_KNOWN = _SECTIONS | _LEAVES | {k for k in verl_keys.KEYS if not k.endswith("*")} \
    | verl_keys.sections()
_SUGGEST = sorted(_KNOWN)


# omegaconf would turn 2 or "yes" into True for these: they take only true/false
_BOOL_LEAVES = {p for p, hint in leaf_types().items() if hint is bool or hint == Optional[bool]}
_DEFAULTS = OmegaConf.structured(MegaRLConfig)  # copied per load: building it is the slow part

# A megarl config is a few KiB with a few hundred values; these bounds are far above any real
# one and far below what makes the YAML composer, omegaconf or int() slow or crash.
YAML_LIMITS = {
    "bytes": 1 << 20,   # file size
    "depth": 32,        # nested mappings/sequences
    "values": 2_000,    # scalars and collections, every alias counted as what it expands to
    "chars": 4_096,     # one scalar (Python refuses int() of over 4,300 digits)
}


def load_config(path: str | None = None, overrides: Sequence[str] = (),
                cuda_devices: Optional[int] = None) -> DictConfig:
    """Merge schema defaults, the YAML file at ``path`` and ``overrides``; validate; freeze.

    ``trainer.device: auto`` and null dtypes are resolved against ``cuda_devices`` GPUs
    (None: as many as torch sees here; see ``megarl.config.device``). Raises ``ConfigError``
    naming the dotted key (and the file) for any problem.
    """
    cfg = copy.deepcopy(_DEFAULTS)
    from_file: set[str] = set()  # keys whose value is the file's (no override replaced it)
    verl_given: dict[str, tuple[Any, str]] = {}  # verl's keys megarl has not: (value, where)
    if path is not None:
        source = str(path)
        assignments = _expand_all(_read_yaml(path).items(), source, verl_given)
        cfg = _apply(cfg, assignments, source)
        from_file = {key for key, _ in assignments}
    assignments = _expand_all((_split_override(o) for o in overrides), None, verl_given)
    cfg = _apply(cfg, assignments, None)
    overridden = {key for key, _ in assignments}
    from_file -= overridden
    if verl_given:
        verl_keys.apply(cfg, verl_given, {**dict.fromkeys(from_file, 1),
                                          **dict.fromkeys(overridden, 2)})

    # Resolved here, once, so that no consumer has to know the fallback.
    try:
        resolved = resolve_device(cfg, cuda_devices)
    except OmegaConfBaseException:
        resolved = None  # an interpolation that cannot resolve: validate_config names its key
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.max_new_tokens is None:
        rollout.max_new_tokens = cfg.data.max_response_length
    _resolve_ahead(cfg, from_file, overridden, path)
    _resolve_tis_alias(cfg, from_file | overridden)
    logp, actor = cfg.actor_rollout_ref.logp, cfg.actor_rollout_ref.actor.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if logp[key] is None:  # the replica's layout is the actor's unless it says otherwise
            logp[key] = actor[key]
    try:
        validate_config(cfg)
        rollout.update_group_backend = update_group_backend(cfg, plan_task_groups(cfg))
    except ConfigError as err:
        # A rule names the key at fault; where the file set it, name the file as well.
        key = re.sub(r"\[\d+\]", "", str(err).partition(":")[0])
        if any(key == k or key.startswith(k + ".") for k in from_file):
            raise ConfigError(f"{err}{_where(str(path))}") from None
        raise
    announce(resolved)
    OmegaConf.set_readonly(cfg, True)
    return cfg


_ASYNC, _AHEAD = "actor_rollout_ref.async_pipeline", "trainer.generate_ahead_steps"


def _resolve_ahead(cfg: DictConfig, from_file: set[str], overridden: set[str],
                   path: str | None) -> None:
    """`trainer.generate_ahead_steps` is the one knob; the seed's `async_pipeline` is an alias
    that sets it: on means one step ahead (2) unless more is asked, off means on-policy (1).

    Both keys are kept equal. The one given closer to the run wins (an override beats the
    file, the file beats the default); given at the same level with different meanings, they
    are refused, naming both."""
    on, ahead = cfg.actor_rollout_ref.async_pipeline, cfg.trainer.generate_ahead_steps
    if not isinstance(on, bool) or not isinstance(ahead, int) or isinstance(ahead, bool):
        return  # a wrong type: validate_config names the key

    def rank(key: str) -> int:
        return 2 if key in overridden else 1 if key in from_file else 0

    if on == (ahead > 1):
        return
    if rank(_ASYNC) == rank(_AHEAD):
        where = "" if rank(_ASYNC) == 2 else _where(str(path))
        raise ConfigError(
            f"{_AHEAD}: {ahead} and {_ASYNC}: {str(on).lower()} contradict each other{where} "
            f"({_ASYNC} is an alias: true means {_AHEAD} >= 2, false means 1); give one")
    if rank(_ASYNC) > rank(_AHEAD):
        cfg.trainer.generate_ahead_steps = 2 if on else 1
    else:
        cfg.actor_rollout_ref.async_pipeline = ahead > 1


_CAP, _LEVEL = "actor_rollout_ref.actor.tis_imp_ratio_cap", "actor_rollout_ref.actor.tis_level"
_RC = "algorithm.rollout_correction"


def _resolve_tis_alias(cfg: DictConfig, given: set[str]) -> None:
    """megarl's `actor.tis_imp_ratio_cap`/`tis_level` are the plain-TIS spelling of verl's
    `algorithm.rollout_correction.rollout_is`/`rollout_is_threshold`: the same weight,
    min(pi_old/pi_rollout, C) per token or per sequence. With `rollout_is` set, megarl's keys
    take its values (a plain threshold) and may be given only with those values; under
    `bypass_mode` (old policy = rollout policy, so their weight is 1) they may not be given.
    With `rollout_is` null megarl's keys govern, as they always did."""
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is None and not rc.bypass_mode:
        return
    from megarl.algo.rollout_correction import RolloutCorrection

    try:
        parsed = RolloutCorrection.from_config(rc)
    except ValueError:
        return  # validate_config names the key
    actor = cfg.actor_rollout_ref.actor
    mine = [k for k in (_CAP, _LEVEL) if k in given]
    if parsed.bypass_mode:
        if mine:
            raise ConfigError(f"{mine[0]}: does nothing under {_RC}.bypass_mode=true (the "
                              f"rollout log-probs are the old policy, so pi_old/pi_rollout = 1); "
                              f"bypass mode's weight is {_RC}.rollout_is's")
        return
    tis = parsed.plain_tis
    for key in mine:
        value = actor.tis_level if key == _LEVEL else actor.tis_imp_ratio_cap
        if tis is None:
            raise ConfigError(
                f"{key}: {value} is megarl's truncated weight, and {_RC} asks for one it cannot "
                f"say (rollout_is_threshold={rc.rollout_is_threshold!r}, "
                f"rollout_is_batch_normalize={rc.rollout_is_batch_normalize}); give only {_RC}")
        theirs = (f"{_RC}.rollout_is: {tis[0]}" if key == _LEVEL
                  else f"{_RC}.rollout_is_threshold: {rc.rollout_is_threshold}")
        if value != (tis[0] if key == _LEVEL else tis[1]):
            raise ConfigError(f"{key}: {value} and {theirs} set the same importance weight "
                              f"differently ({key} is megarl's name for it); give one")
    if tis is not None:
        actor.tis_level, actor.tis_imp_ratio_cap = tis


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML, interpolations resolved."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def _read_yaml(path: str | os.PathLike) -> dict:
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a config file (a .yaml file)")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not a regular file, not a config file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(YAML_LIMITS["bytes"] + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(raw) > YAML_LIMITS["bytes"]:
        raise ConfigError(f"{path}: larger than {YAML_LIMITS['bytes'] >> 10} KiB; not a config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte {raw[err.start]:#04x} at line {line} "
                          f"(offset {err.start})") from None
    data = safe_load(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _split_override(text: str) -> tuple[str, Any]:
    # Hydra's "+" (add) and "++" (add or override) mean nothing more here: every key exists.
    key, sep, raw = text.lstrip("+").partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value")
    if key.startswith("~"):
        raise ConfigError(f"override {text!r}: deleting keys (~key) is not supported")
    return key, safe_load(raw, f"override {key}")


# text -> what it parsed to (a copy is handed out). The same files and overrides are parsed
# again and again: `megarl plan` loads a config for every layout it weighs (hundreds), and
# PyYAML's pure-Python parser was a third of that time.
_PARSED: dict[str, Any] = {}
_PARSED_MAX = 256


def safe_load(text: str, where: str) -> Any:
    """Parse YAML ``text`` within ``YAML_LIMITS``; any problem is a one-line ``ConfigError``
    starting with ``where`` (the file, or the override's key)."""
    if text in _PARSED:
        return copy.deepcopy(_PARSED[text])
    try:
        _check_structure(text, where)
        data = yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_reason(err)}") from None
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[text] = data
    return copy.deepcopy(data)


def _check_structure(text: str, where: str) -> None:
    """Walk the event stream (iterative, builds nothing) and refuse text over the limits.

    Each open collection counts the values under it, an alias adding the size its anchor
    expanded to, so 6 levels of 10 aliases count as the million values they would build.
    """
    sizes: dict[str, int] = {}              # anchor -> values it expands to
    open_: list[list] = [[None, 0]]         # [anchor, values so far] per open collection
    for event in yaml.parse(text, Loader=_YamlLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1])
            if len(open_) - 1 > YAML_LIMITS["depth"]:
                raise ConfigError(f"{where}: nested deeper than {YAML_LIMITS['depth']} levels "
                                  f"{_at(event)}")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_.pop()
        elif isinstance(event, yaml.ScalarEvent):
            if len(event.value) > YAML_LIMITS["chars"]:
                raise ConfigError(f"{where}: a value of {len(event.value)} characters "
                                  f"{_at(event)}; at most {YAML_LIMITS['chars']}")
            anchor, size = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, sizes.get(event.anchor, 1)
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        open_[-1][1] += size
        if open_[-1][1] > YAML_LIMITS["values"]:
            raise ConfigError(f"{where}: more than {YAML_LIMITS['values']} values with "
                              f"aliases expanded {_at(event)}; refusing to build it")


def _at(event: yaml.Event) -> str:
    return f"at line {event.start_mark.line + 1}" if event.start_mark else ""


def _yaml_reason(err: yaml.YAMLError) -> str:
    """One line from a PyYAML error (its ``str`` spans several, with a code snippet)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return where + ": ".join(p for p in (err.context, err.problem) if p)
    if isinstance(err, yaml.reader.ReaderError):
        char = err.character
        shown = f"#x{char:04x}" if isinstance(char, int) else repr(char)
        return f"character {err.position}: unacceptable character {shown}"
    return str(err).splitlines()[0]


def _expand_all(items, source: str | None,
                verl_given: dict[str, tuple[Any, str]]) -> list[tuple[str, Any]]:
    """Leaf assignments from (key, value) pairs; aliases resolved, conflicts rejected.

    verl's keys that are not megarl's go to ``verl_given`` (a later source replaces an
    earlier one's value), for ``verl_keys.apply``."""
    assigned: dict[str, tuple[str, Any]] = {}
    for key, value in items:
        for canonical, original, leaf_value in _expand(str(key), value, source):
            if verl_keys.unset(original, leaf_value):
                continue  # verl's "derive it" default: megarl's own default stands
            if not _megarl_key(canonical):
                verl_given[canonical] = (leaf_value, _where(source))
                continue
            if canonical in assigned:
                prev_key, prev_value = assigned[canonical]
                if prev_key != original and prev_value != leaf_value:
                    raise ConfigError(
                        f"`{prev_key}` and `{original}` are the same key ({canonical}) with "
                        f"different values{_where(source)}; give one of them")
            assigned[canonical] = (original, leaf_value)
    return [(canonical, value) for canonical, (_, value) in assigned.items()]


def _expand(key: str, value: Any, source: str | None) -> Iterator[tuple[str, str, Any]]:
    """Yield (canonical key, key as written, value) per schema leaf under ``key``."""
    canonical = ALIASES.get(key, key)
    if not _megarl_key(canonical):
        if verl_keys.is_section(canonical) and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                yield from _expand(f"{key}.{sub_key}", sub_value, source)
            return
        if verl_keys.lookup(canonical) is not None:
            yield canonical, key, value
            return
    _check_known(canonical, key, source)
    if canonical in _SECTIONS:
        if not isinstance(value, dict):
            raise ConfigError(f"{canonical}: is a section and needs a mapping, got "
                              f"{value!r}{_where(source)}")
        for sub_key, sub_value in value.items():
            yield from _expand(f"{key}.{sub_key}", sub_value, source)
    else:
        yield canonical, key, value


def _megarl_key(path: str) -> bool:
    """A section or leaf of megarl's schema, or a sub-key of one of its open mappings."""
    if path in _SECTIONS or path in _LEAVES:
        return True
    parts = path.split(".")
    return any(".".join(parts[:d]) in _OPEN_LEAVES for d in range(1, len(parts)))


def _check_known(canonical: str, written: str, source: str | None) -> None:
    parts = canonical.split(".")
    for depth in range(1, len(parts) + 1):
        path = ".".join(parts[:depth])
        if path in _OPEN_LEAVES:
            return
        if path in _LEAVES and depth < len(parts):
            raise ConfigError(f"unknown config key `{written}`{_where(source)}: "
                              f"`{path}` is a value, not a section")
        if path not in _SECTIONS and path not in _LEAVES:
            raise ConfigError(f"unknown config key `{written}`{_where(source)}"
                              f"{_did_you_mean(parts, depth - 1)}")


def _did_you_mean(parts: list[str], bad: int) -> str:
    """Suggest a known path for ``parts`` whose component ``bad`` is unknown, only where it is
    plausibly the same setting: a near spelling among the siblings (a typo), a near spelling of
    the whole path, or the same name in another section when exactly one section has it. A
    loose match misleads more than none (`megatron.param_offload` is not `params_dtype`)."""
    parent = ".".join(parts[:bad])
    siblings = [p.rpartition(".")[2] for p in _SUGGEST if p.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(parts[bad], siblings, n=1, cutoff=0.85)
    if close:
        guess = ".".join(parts[:bad] + close + parts[bad + 1:])
        if guess in _KNOWN:
            return f"; did you mean `{guess}`?"
    full = ".".join(parts)
    close = difflib.get_close_matches(full, _SUGGEST, n=1, cutoff=0.9)
    if not close:  # right name, wrong section: trainer.async_pipeline
        same_name = [p for p in _SUGGEST if p.endswith("." + parts[-1])]
        close = same_name if len(same_name) == 1 else []
    return f"; did you mean `{close[0]}`?" if close else ""


def _apply(cfg: DictConfig, assignments: list[tuple[str, Any]], source: str | None) -> DictConfig:
    for key, value in assignments:
        verl_keys.check_value(key, value, _where(source))
        if key in _BOOL_LEAVES and not isinstance(value, bool) and not _interpolation(value):
            raise ConfigError(f"{key}: must be true or false, got {show(value)}"
                              f"{_where(source)}")
        if isinstance(value, str) and value == "???":
            # omegaconf's "missing" marker: merged in, it would silently keep the old value
            raise ConfigError(f"{key}: '???' is not a value{_where(source)}")
        try:
            OmegaConf.update(cfg, key, value, merge=True)  # in place, and only the one key
        except (OmegaConfBaseException, TypeError, ValueError) as err:
            # omegaconf raises a bare TypeError for a mapping merged onto a list and back;
            # its reason quotes the value, which may be long
            reason = str(err).splitlines()[0]
            reason = reason if len(reason) <= 160 else reason[:157] + "..."
            raise ConfigError(f"{key}: {reason}{_where(source)}") from None
    return cfg


def _interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""
