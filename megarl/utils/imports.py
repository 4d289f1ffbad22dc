"""User code named by an import path: ``module:function`` or ``path/to/file.py:function``.

One loader for every extension point (``reward.reward_fn``,
``actor_rollout_ref.rollout.rollout_fn``); each error names the config key it came from.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Callable

from .errors import ConfigError


def check_import_path(path: str, key: str) -> None:
    """The shape alone (`module:function`), for the config check before anything imports."""
    if path.count(":") != 1 or not all(p.strip() for p in path.split(":")):
        raise ConfigError(f"{key}: {path!r} is not an import path `module:function` "
                          "(or `file.py:function`)")


def load_callable(path: str, key: str) -> Callable:
    check_import_path(path, key)
    module_name, _, fn_name = path.partition(":")
    module = _import_module(module_name.strip(), path, key)
    fn = getattr(module, fn_name.strip(), None)
    if fn is None:
        raise ConfigError(f"{key}: {path!r}: module {module_name!r} has no attribute "
                          f"{fn_name!r}")
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r}: {fn_name!r} is not callable")
    return fn


def _import_module(spec: str, path: str, key: str):
    if spec.endswith(".py"):
        file = Path(spec)
        if file.is_dir():
            raise ConfigError(f"{key}: {path!r}: {file} is a directory, not a Python file")
        if not file.is_file():
            raise ConfigError(f"{key}: {path!r}: no such file {file}")
        name = f"megarl_user_{key.rpartition('.')[2]}_{file.stem}"
        mod_spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as err:
            raise ConfigError(f"{key}: {path!r}: importing {file} failed: "
                              f"{type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(spec)
    except Exception as err:  # ImportError, or any error raised by the module's own code
        raise ConfigError(f"{key}: {path!r}: cannot import module {spec!r}: "
                          f"{type(err).__name__}: {err}") from err
