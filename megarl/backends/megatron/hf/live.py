"""Load HF weights into, and stream HF-named full tensors out of, a live sharded Megatron model.

Every rank holds one TP slice of one PP stage, and of a mixture of experts one EP rank's
experts (num_experts / EP consecutive ones), each split over the expert-TP ranks. Loading:
each rank builds the full Megatron tensors it needs from the HF files and keeps its slice.
Export: per parameter, the TP group (an expert's: the expert-TP group, then the EP group, so
every rank gets every expert) all-gathers the slices and the full tensor is renamed to HF;
each PP stage yields only its own layers (global indices), which is what the per-stage
weight-sync producer needs. Nothing ever materialises more than one full tensor at a time
(an expert's: EP of them, one per EP rank).
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


def chunks(model) -> list:
    """The GPTModels of this rank: its model chunks in order under a virtual pipeline (a
    list, or `model.ModelChunks`), else the one model."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return [unwrap(m) for m in model]
    return [unwrap(model)]


def global_name(model, local_name: str) -> str:
    """Megatron parameter name with the stage-local layer index replaced by the global one,
    and a routed expert's EP-local index by its global one, in the local spec's names
    whichever spec built the model (Transformer Engine's fuses the norms into the linears)."""
    layer, suffix = mapping.split_layer_name(local_name)
    if layer is None:
        return local_name
    number = unwrap(model).decoder.layers[layer].layer_number  # 1-based, global
    expert = mapping.expert_index(suffix)
    if expert is not None:
        suffix = mapping.with_expert_index(suffix, expert + _expert_offset(model))
    return mapping.local_name(f"decoder.layers.{number - 1}.{suffix}")


def _local_experts(model) -> int:
    from megatron.core import parallel_state as ps

    return chunks(model)[0].config.num_moe_experts // ps.get_expert_model_parallel_world_size()


def _expert_offset(model) -> int:
    """The global index of this EP rank's first expert."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * _local_experts(model)


def _tp_of(name: str) -> tuple[int, int, object]:
    """(world size, rank, group) of the ranks `name` is split over: a routed expert's
    expert-TP ranks, every other tensor's TP ranks."""
    from megatron.core import parallel_state as ps

    if mapping.expert_index(mapping.split_layer_name(name)[1]) is not None:
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def is_value_model(model) -> bool:
    """A critic: its last stage ends in a value head, not the vocab-parallel output layer."""
    from megarl.backends.megatron.model import ValueHead

    return any(isinstance(getattr(c, "output_layer", None), ValueHead) for c in chunks(model))


def _padded_vocab(model) -> int:
    return chunks(model)[0].vocab_size  # GPTModel keeps the padded size it was built with


def named_tensors(model):
    """(chunk, stage-local name, tensor) over this rank's model chunks in chunk order: the
    parameters, then the buffers that are checkpoint values (a sigmoid router's
    `expert_bias`). Under a virtual pipeline a stage's chunks hold ascending runs of layers,
    so the parameters' names come out in global layer order within the stage, and the buffers
    after all of them, as the dry run's plan has them."""
    for chunk in chunks(model):
        for local, p in chunk.named_parameters():
            yield chunk, local, p
    for chunk in chunks(model):
        for local, b in chunk.named_buffers():
            if local.endswith(mapping.FP32_BUFFERS):
                yield chunk, local, b


@torch.no_grad()
def load_hf_into(model, args: ModelArgs, get_hf: Callable[[str], torch.Tensor],
                 progress: Callable[[int], None] | None = None,
                 skip: Callable[[str], bool] | None = None) -> None:
    """Copy HF weights into this rank's shard of `model` (every parameter must be covered,
    except those whose Megatron name `skip` accepts: a critic's value head, which a causal LM
    has no weights for); `progress(nbytes)` is called after each parameter with the bytes of
    this rank's shard."""
    padded = _padded_vocab(model)
    value = is_value_model(model)
    for chunk, local, p in named_tensors(model):
        name = global_name(chunk, local)
        if skip is not None and skip(name):
            continue
        if value and name in mapping.VALUE_HEAD:  # replicated: every rank takes it whole
            p.copy_(get_hf(mapping.VALUE_HEAD[name]).reshape(p.shape).to(p.dtype))
            continue
        full = mapping.mcore_from_hf(name, get_hf, args, padded)
        tp, rank, _ = _tp_of(name)
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

    Every TP rank must iterate the generator to the end (they all take part in the gathers),
    and of a mixture of experts every rank of the stage (the EP gathers cross data-parallel
    ranks); each receives the same full tensors. The output layer of a tied model is skipped:
    HF keeps only the embedding.
    """
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size() if args.is_moe else 1
    value = is_value_model(model)
    for chunk, local, p in named_tensors(model):
        name = global_name(chunk, local)
        if value and name in mapping.VALUE_HEAD:  # a critic's head: replicated, not gathered
            t = p.detach()
            yield mapping.VALUE_HEAD[name], t if dtype is None else t.to(dtype)
            continue
        if name == "output_layer.weight" and args.tie_word_embeddings:
            continue
        t = p.detach()
        tp, _, group = _tp_of(name)
        if tp > 1 and mapping.partition_dim(name) is not None:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = mapping.unshard(name, parts)
        expert = mapping.expert_index(mapping.split_layer_name(name)[1])
        if expert is None or ep == 1:
            named = [(name, t)]
        else:  # the same local expert of every EP rank: global index rank * local + i
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_expert_model_parallel_group())
            first = expert - _expert_offset(model)
            layer, suffix = mapping.split_layer_name(name)
            named = [(f"decoder.layers.{layer}."
                      f"{mapping.with_expert_index(suffix, first + r * _local_experts(model))}",
                      part) for r, part in enumerate(parts)]
        for mname, full in named:
            keep = mname.endswith(mapping.FP32_BUFFERS)  # the engines want it in fp32
            for hf_name, hf_t in mapping.hf_from_mcore(mname, full, args):
                yield hf_name, hf_t if dtype is None or keep else hf_t.to(dtype)
