"""Megatron's `@jit_fuser` functions compiled when first called, not at import.

`megatron.core.jit` binds `jit_fuser = torch.compile`, and 15 Megatron modules decorate fused
kernels with it at import. Decorating is cheap, but the first `torch.compile(fn)` imports
torch._dynamo and torch._inductor: 1.8 s of CPU in every process that imports megatron.core
(measured on torch 2.13, megatron-core 0.16.1: 4.9 s -> 3.1 s for torch + megatron.core +
transformers), paid by every trainer, reference and log-prob worker and by every tool that
loads a checkpoint. megarl turns the fusions off by default (`model.py`), so most processes
never call one of these kernels at all.

`install()` puts a finder on `sys.meta_path` that, when `megatron.core.jit` is imported (it
is the first Megatron module to bind the name, before any fused module imports it), wraps its
`jit_fuser` so each decorated function calls `torch.compile` on its first call. That is when
`torch.compile` would have compiled it anyway (its wrapper compiles lazily), so a process that
calls a fused kernel runs the same compiled code; only the import of the compiler moves.
Importing megatron.core before `install()` (a script doing so itself) keeps Megatron as
shipped.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_MODULE = "megatron.core.jit"


def _deferred(compile_fn):
    """`compile_fn` (torch.compile) applied at a decorated function's first call."""

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


class _Loader(importlib.abc.Loader):
    def __init__(self, real):
        self._real = real

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        import torch

        # only the compiling fuser is deferred: torch.jit.script or a no-op stay as they are
        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = _deferred(torch.compile)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; does nothing once megatron.core.jit is imported."""
    if _MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
