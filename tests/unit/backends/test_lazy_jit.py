"""megarl.backends.megatron._lazy_jit: Megatron's `@jit_fuser` kernels compile on first call."""
import subprocess
import sys

from megarl.backends.megatron import _lazy_jit


def test_a_deferred_function_is_compiled_once_at_its_first_call():
    compiled = []

    def compile_fn(fn):
        compiled.append(fn.__name__)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    @_lazy_jit._deferred(compile_fn)
    def bias_gelu(x, bias=0):
        """doc"""
        return x + bias

    assert compiled == [] and bias_gelu.__name__ == "bias_gelu" and bias_gelu.__doc__ == "doc"
    assert bias_gelu(1, bias=2) == ("compiled", 3)
    assert bias_gelu(4) == ("compiled", 4)
    assert compiled == ["bias_gelu"]


def test_megatron_imported_through_megarl_loads_no_compiler():
    code = (
        "import sys, torch\n"
        "import megarl.backends.megatron\n"
        "import megatron.core, megatron.core.models.gpt, megatron.core.optimizer\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_swiglu as f\n"
        "assert jit.jit_fuser is not torch.compile, jit.jit_fuser\n"
        "assert '_deferred' in f.bias_swiglu.__code__.co_qualname, f.bias_swiglu\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
