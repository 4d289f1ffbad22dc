"""Import shims that let the stock sglang 0.5.23 server run on a CPU without sgl-kernel.

megarl's launcher puts this folder first on PYTHONPATH of a stock server it starts on a CPU
(`megarl.backends.sglang.cpu_env.server_env`), so Python loads this file at start-up in the
server process and in every scheduler/detokenizer process sglang spawns. It changes nothing
else: no sglang file is edited, and a process without `MEGARL_SGLANG_CPU_SHIM=1` is left alone
(so a PYTHONPATH that leaks into another program is harmless).

1. torchvision. The only torchvision wheel for torch 2.13 on PyPI is a CUDA build whose C
   extension does not load beside CPU torch; its Python part then registers fake kernels for
   ops that were never defined (`torchvision::nms`), which raises. sglang imports torchvision
   unconditionally (multimodal helpers), so the server would not start. Here registering a
   fake kernel for a torchvision op that does not exist does nothing.
2. sgl_kernel. With `SGLANG_USE_CPU_ENGINE=1`, a handful of sglang modules import `*_cpu`
   kernels from `sgl_kernel` when they are imported, and no CPU build of sgl-kernel exists on
   PyPI. A stand-in module answers every `*_cpu` name with a function that raises if called;
   plain serving (no speculative decoding, no AMX) calls none of them, and because
   `torch.ops.sgl_kernel` stays empty sglang's AMX probe is false and it takes its torch-native
   paths. Any other `from sgl_kernel import X` still fails as it would without the package.
3. Unpinned host buffers. sglang allocates its host-side buffers (the routed-experts capture
   buffer of `--enable-return-routed-experts`, HiCache host pools) through
   `pool_host.common.ALLOC_MEMORY_FUNCS[device]`, whose default pins them with
   `cudaHostRegister`; CPU torch has no CUDA, so the server fails at start-up. Pinning only
   speeds up copies between a GPU and the host; with the CPU engine the "device" is the host,
   so here the "cpu" entry allocates the same buffer with the same allocator, unpinned.
4. DeepSeek-V3's attention on torch_native. sglang's DeepSeek model picks its attention method
   per backend from `AttentionBackendRegistry`; torch_native has no entry, so it falls back to
   triton's choice, whose prefill takes the MHA path, while torch_native then reads K/V from
   the latent (MLA) pool: wrong tokens. Registered here, torch_native takes the absorbed MLA
   method (the one every other MLA backend decodes with; `_dispatch_mla_subtype`), and a
   tiny DeepSeek-V3 then serves what transformers computes (tests/stock/test_stock_deepseek.py).
"""
import logging
import os
import sys

logger = logging.getLogger("megarl.sglang_cpu_shim")


def _skip_missing_torchvision_fakes() -> None:
    import torch
    import torch.library

    register_fake = torch.library.register_fake

    def guarded(op, func=None, /, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            name = op.split("::", 1)[1].split(".", 1)[0]
            if not hasattr(torch.ops.torchvision, name):
                return (lambda f: f) if func is None else func
        return register_fake(op, func, *args, **kwargs)

    torch.library.register_fake = guarded


def _stand_in_sgl_kernel() -> None:
    import types

    if "sgl_kernel" in sys.modules:
        return
    module = types.ModuleType("sgl_kernel")
    module.__file__ = __file__

    def missing(name):
        def kernel(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name}: no CPU sgl-kernel is installed "
                                      f"(megarl's CPU shim, {__file__})")
        kernel.__name__ = name
        return kernel

    def getattr_(name):
        if name.endswith("_cpu"):
            return missing(name)
        raise AttributeError(name)

    module.__getattr__ = getattr_
    sys.modules["sgl_kernel"] = module


def _after_import(name: str, patch) -> None:
    """Call `patch(module)` once the module `name` has been executed, without importing it
    here: sglang must not be imported at interpreter start-up (this file runs in every
    process, before sglang's own set-up)."""
    import importlib.abc

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # once; the other finders locate the real module
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find else None
                if spec is not None:
                    break
            else:
                return None
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def _unpinned_cpu_host_buffers(common) -> None:
    register = common.alloc_with_host_register

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator,
                       registration_granularity_bytes=None):
        # pin_memory=False: same allocator and layout, no cudaHostRegister
        return register(dims, dtype, device, False, allocator, registration_granularity_bytes)

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned
    logger.debug("megarl CPU shim: host buffers on device 'cpu' are not pinned")


def _torch_native_mla(handlers) -> None:
    handlers.AttentionBackendRegistry.register(
        "torch_native", lambda attn, forward_batch: handlers._dispatch_mla_subtype(
            attn, forward_batch))
    logger.debug("megarl CPU shim: DeepSeek MLA on torch_native takes the absorbed MLA method")


if os.environ.get("MEGARL_SGLANG_CPU_SHIM") == "1":
    _skip_missing_torchvision_fakes()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        _stand_in_sgl_kernel()
        _after_import("sglang.srt.mem_cache.pool_host.common", _unpinned_cpu_host_buffers)
        _after_import("sglang.srt.models.deepseek_common.attention_backend_handler",
                      _torch_native_mla)
