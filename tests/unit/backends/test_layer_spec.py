"""The transformer layer implementation: Transformer Engine where usable, else local."""
import logging

import pytest
import torch

from megarl.backends.megatron import model


def test_auto_without_transformer_engine_or_cuda_builds_local_layers_and_says_so(caplog):
    if model.transformer_engine_usable():
        pytest.skip("Transformer Engine and CUDA are both here: auto picks TE")
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megarl.backends.megatron.attention import SDPAttention

    model._SPEC_LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="megarl.backends.megatron.model"):
        specs = [model.layer_spec("auto") for _ in range(3)]  # three models, one process
    said = [r.getMessage() for r in caplog.records]
    # one line per process, naming the reason
    assert said == ["megatron: Megatron local layers (Transformer Engine not installed or no "
                    "CUDA), torch SDPA attention (attention_backend=auto; packed sequences: "
                    "one SDPA call per length)"], said
    attn = specs[0].submodules.self_attention.submodules
    assert attn.linear_qkv is ColumnParallelLinear
    assert attn.core_attention.module is SDPAttention
    assert attn.core_attention.params == {"backend": "auto"}
    flex = model.layer_spec("local", attention_backend="flex")
    assert flex.submodules.self_attention.submodules.core_attention.params == {"backend": "flex"}
    # the local spec keeps the norms as modules of their own, under the names the HF map uses
    assert specs[0].submodules.input_layernorm is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Transformer Engine)")
def test_transformer_engine_layers_fuse_the_norms_into_the_linears():
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine (GPU extra)")
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    spec = model.layer_spec("transformer_engine")
    attn = spec.submodules.self_attention.submodules
    assert attn.linear_qkv is TELayerNormColumnParallelLinear
    # TE's layers as Megatron ships them: TE's own attention, no SDPA forced in
    assert attn.core_attention is TEDotProductAttention
