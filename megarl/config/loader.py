"""Load a megarl config: schema defaults < YAML file < command-line overrides.

This module owns how text becomes a config: reading the YAML file, parsing Hydra-style
``key=value`` / ``+key=value`` / ``++key=value`` overrides (values parsed as YAML), the
``sperated_*`` aliases, and the unknown-key and type errors (with a did-you-mean). It then
fills derived defaults and calls ``validate_config``. There is no Hydra: no config groups,
no ``defaults`` list, no ``~key`` deletion; one YAML file and a flat list of overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Iterator, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.errors import ConfigError
from megarl.config.schema import MegaRLConfig
from megarl.config.validate import validate_config

# The feature request that started the project spelled these "sperated"; both spellings work.
ALIASES = {
    "trainer.sperated_node_tasks": "trainer.separated_node_tasks",
    "trainer.sperated_node_ratios": "trainer.separated_node_ratios",
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


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Merge schema defaults, the YAML file at ``path`` and ``overrides``; validate; freeze.

    Raises ``ConfigError`` naming the dotted key (and the file) for any problem.
    """
    cfg = OmegaConf.structured(MegaRLConfig)
    if path is not None:
        source = str(path)
        cfg = _apply(cfg, _expand_all(_read_yaml(path).items(), source), source)
    cfg = _apply(cfg, _expand_all((_split_override(o) for o in overrides), None), None)

    # Resolved here, once, so that no consumer has to know the fallback.
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.max_new_tokens is None:
        rollout.max_new_tokens = cfg.data.max_response_length
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML, interpolations resolved."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def _read_yaml(path: str | os.PathLike) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.load(fh, Loader=_YamlLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
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
    try:
        value = yaml.load(raw, Loader=_YamlLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML: {err}") from None
    return key, value


def _expand_all(items, source: str | None) -> list[tuple[str, Any]]:
    """Leaf assignments from (key, value) pairs; aliases resolved, conflicts rejected."""
    assigned: dict[str, tuple[str, Any]] = {}
    for key, value in items:
        for canonical, original, leaf_value in _expand(str(key), value, source):
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
    _check_known(canonical, key, source)
    if canonical in _SECTIONS:
        if not isinstance(value, dict):
            raise ConfigError(f"{canonical}: is a section and needs a mapping, got "
                              f"{value!r}{_where(source)}")
        for sub_key, sub_value in value.items():
            yield from _expand(f"{key}.{sub_key}", sub_value, source)
    else:
        yield canonical, key, value


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
    """Suggest a known path for ``parts`` whose component ``bad`` is unknown."""
    parent = ".".join(parts[:bad])
    siblings = [p.rpartition(".")[2] for p in _ALL_PATHS if p.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(parts[bad], siblings, n=1)
    if close:
        guess = ".".join(parts[:bad] + close + parts[bad + 1:])
        if guess in _SECTIONS or guess in _LEAVES:
            return f"; did you mean `{guess}`?"
    full = ".".join(parts)
    close = difflib.get_close_matches(full, _ALL_PATHS, n=1, cutoff=0.7)
    if not close:  # right name, wrong section: trainer.async_pipeline
        close = [p for p in _ALL_PATHS if p.endswith("." + parts[-1])][:1]
    return f"; did you mean `{close[0]}`?" if close else ""


def _apply(cfg: DictConfig, assignments: list[tuple[str, Any]], source: str | None) -> DictConfig:
    for key, value in assignments:
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        try:
            cfg = OmegaConf.merge(cfg, nested)
        except OmegaConfBaseException as err:
            reason = str(err).splitlines()[0]
            raise ConfigError(f"{key}: {reason}{_where(source)}") from None
    return cfg


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""
