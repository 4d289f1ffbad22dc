"""Load HF weights into, and stream HF-named full tensors out of, a live sharded Megatron model.

Every rank holds one TP slice of one PP stage. Loading: each rank builds the full Megatron
tensors it needs from the HF files and keeps its slice. Export: per parameter, the TP group
all-gathers the slices and the full tensor is renamed to HF; each PP stage yields only its own
layers (global indices), which is what the per-stage weight-sync producer needs. Nothing ever
materialises more than one full tensor at a time.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.backends.megatron.model import ModelArgs

from . import mapping


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def global_name(model, local_name: str) -> str:
    """Megatron parameter name with the stage-local layer index replaced by the global one,
    in the local spec's names whichever spec built the model (Transformer Engine's fuses the
    norms into the linears)."""
    layer, suffix = mapping.split_layer_name(local_name)
    if layer is None:
        return local_name
    number = unwrap(model).decoder.layers[layer].layer_number  # 1-based, global
    return mapping.local_name(f"decoder.layers.{number - 1}.{suffix}")


def is_value_model(model) -> bool:
    """A critic: its last stage ends in a value head, not the vocab-parallel output layer."""
    from megarl.backends.megatron.model import ValueHead

    return isinstance(getattr(unwrap(model), "output_layer", None), ValueHead)


def _padded_vocab(model) -> int:
    return unwrap(model).vocab_size  # GPTModel keeps the padded size it was built with


@torch.no_grad()
def load_hf_into(model, args: ModelArgs, get_hf: Callable[[str], torch.Tensor],
                 progress: Callable[[int], None] | None = None,
                 skip: Callable[[str], bool] | None = None) -> None:
    """Copy HF weights into this rank's shard of `model` (every parameter must be covered,
    except those whose Megatron name `skip` accepts: a critic's value head, which a causal LM
    has no weights for); `progress(nbytes)` is called after each parameter with the bytes of
    this rank's shard."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = _padded_vocab(model)
    value = is_value_model(model)
    for local, p in unwrap(model).named_parameters():
        name = global_name(model, local)
        if skip is not None and skip(name):
            continue
        if value and name in mapping.VALUE_HEAD:  # replicated: every rank takes it whole
            p.copy_(get_hf(mapping.VALUE_HEAD[name]).reshape(p.shape).to(p.dtype))
            continue
        full = mapping.mcore_from_hf(name, get_hf, args, padded)
        piece = mapping.shard(name, full, tp, rank)
        if piece.shape != p.shape:
            raise ValueError(f"{name}: HF gives shard {tuple(piece.shape)}, model has "
                             f"{tuple(p.shape)} (TP={tp})")
        p.copy_(piece.to(p.dtype))
        if progress is not None:
            progress(p.numel() * p.element_size())


@torch.no_grad()
def export_hf(model, args: ModelArgs, dtype: torch.dtype | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this PP stage's (HF name, full tensor) pairs; collective over the TP group.

    Every TP rank must iterate the generator to the end (they all take part in the gathers);
    each receives the same full tensors. The output layer of a tied model is skipped: HF keeps
    only the embedding.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    value = is_value_model(model)
    for local, p in unwrap(model).named_parameters():
        name = global_name(model, local)
        if value and name in mapping.VALUE_HEAD:  # a critic's head: replicated, not gathered
            t = p.detach()
            yield mapping.VALUE_HEAD[name], t if dtype is None else t.to(dtype)
            continue
        if name == "output_layer.weight" and args.tie_word_embeddings:
            continue
        t = p.detach()
        if tp > 1 and mapping.partition_dim(name) is not None:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = mapping.unshard(name, parts)
        for hf_name, hf_t in mapping.hf_from_mcore(name, t, args):
            yield hf_name, hf_t if dtype is None else hf_t.to(dtype)
