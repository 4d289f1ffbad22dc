"""The Megatron worker: one rank's shard of a policy, reference or value (critic) model.

Coarse operations only — `compute_logp`, `train_step`, `compute_values`, `train_values`,
`export_hf`, `save`/`load` — so the Ray actor around it stays thin. Every rank of the
TP×PP×DP world calls the same method with its data-parallel share of the batch; results are
returned on every rank.

Batch layout (right-padded, token-aligned): `input_ids` [B, S], `attention_mask` [B, S]
(1 for real tokens). `logprobs[b, t]` is log p(input_ids[b, t] | input_ids[b, :t]) under
softmax(logits / temperature); position 0 has no prediction and is 0. A critic's
`values[b, t]` is its value of the state *before* token t, i.e. its head's output at position
t - 1 (the prefix input_ids[b, :t]); position 0 is 0. That is verl's alignment
(values[:, -response_length - 1:-1] of the critic's output), and it puts the value of the state
a response token was sampled in at that token, beside the token's log-prob and reward.

`micro_batch_size` is rows per micro-batch, or a `packing.TokenBudget`: micro-batches of at
most that many real tokens, each packed into one row (no compute on padding); the outputs and
the losses are the same either way (tests/integration/test_packing.py).

Under context parallelism (`context_parallel`, context_parallel.py) each CP rank runs its
chunks of every sequence; per-token outputs are gathered over the CP group before any loss
or caller sees them, so everything above holds unchanged.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.backends.megatron.hf import live
from megarl.backends.megatron.hf.hf_io import HFReader
from megarl.backends.megatron.hf.model_config import check_layout, read_model_args

from . import context_parallel as cpar
from . import model as mmodel
from .logprobs import token_logprobs
from .optim import OptimConfig, build_optimizer
from .packing import TokenBudget, balanced_partition, count_micro_batches, pack, row_lengths, \
    unpack_shifted
from .parallel import init_distributed

logger = logging.getLogger(__name__)

# loss_fn(logprobs [b, S], entropy [b, S] or None, micro_batch dict) -> (loss, metrics dict).
# The returned loss is this micro-batch's *contribution* to the step's loss (e.g. a sum over its
# tokens divided by the token count of the whole batch), so micro-batching never changes it.
LossFn = Callable[[torch.Tensor, torch.Tensor | None, dict], tuple[torch.Tensor, dict]]


def _split(n: int, mbs: int) -> tuple[int, int]:
    """(micro-batch size, number of micro-batches) for n rows."""
    mbs = max(1, min(mbs, n))
    return mbs, -(-n // mbs)


def _fill_rows(batch: dict, fill: int) -> dict:
    """`batch` with `fill` all-zero rows appended (zero masks: no loss sees them)."""
    return {k: (torch.cat([v, v.new_zeros(fill, *v.shape[1:])]) if torch.is_tensor(v) else v)
            for k, v in batch.items()}


def _layout_stats(batch: dict, mbatches: list[dict], seq: int | None = None) -> dict:
    """This rank's micro-batch count, and the fraction of the token positions it computed
    that were padding (right padding and filler rows; packed: only the tail that evens out
    pipeline stages). `seq`: the length the model ran unpacked rows at, which under sequence
    parallelism exceeds their width by the padding up to a multiple of TP (a packed row
    already holds that padding)."""
    def computed(m: dict) -> int:
        if "_packed" in m:
            return m["_packed"].input_ids.numel()
        rows, width = m["input_ids"].shape
        return rows * max(width, seq or 0)

    slots = sum(computed(m) for m in mbatches)
    mask = batch.get("attention_mask")
    real = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
    return {"micro_batches": float(len(mbatches)), "padding_frac": 1.0 - real / max(slots, 1)}


def _hf_layer_key(name: str) -> tuple[int, int]:
    """Where an HF tensor name sorts: the embedding, the layers by index, then the rest."""
    parts = name.split(".")
    if "layers" in parts[:-1]:
        i = parts.index("layers") + 1
        if parts[i].isdigit():
            return 1, int(parts[i])
    return (0, 0) if "embed_tokens" in name else (2, 0)


class MegatronWorker:
    def __init__(self, model_dir: str, tp: int = 1, pp: int = 1, *, params_dtype="float32",
                 optim: OptimConfig | None = None, make_vocab_size_divisible_by: int = 128,
                 seed: int = 1234, load_hf: bool = True, trainable: bool = True,
                 value_model: bool = False, transformer_impl: str = "auto",
                 collective_timeout_s: float = 600.0, moe: mmodel.MoESettings | None = None,
                 recompute: dict | bool | None = None, sequence_parallel: bool = False,
                 context_parallel: int = 1, vpp: int | None = None,
                 attention_backend: str = "auto",
                 fusions: dict | None = None, logprob_chunk_size: int | None = None):
        # The converter's checks and layout rules, before any collective: a model that cannot
        # split over TP×PP fails here with the converter's message, not a Megatron assertion.
        self.args = read_model_args(model_dir)
        self.moe = moe = moe or mmodel.MoESettings()
        check_layout(self.args, tp, pp, os.path.join(model_dir, "config.json"), moe.ep, moe.etp)
        self.cp = cp = int(context_parallel)
        problem = mmodel.vpp_error(self.args.num_layers, pp, vpp, cp)
        if problem:
            raise ValueError(f"{mmodel.VPP_KEY}={vpp!r}: {problem}")
        self.vpp = vpp if vpp and vpp > 1 else 1
        init_distributed(tp, pp, cp=cp, ep=moe.ep, etp=moe.etp, vpp=self.vpp, seed=seed,
                         timeout_s=collective_timeout_s)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.model_dir = model_dir
        # what a checkpoint of this worker records, for conversion to rebuild the same model
        self.params_dtype, self.vocab_divisor = params_dtype, make_vocab_size_divisible_by
        self.config = mmodel.transformer_config(self.args, tp, pp, params_dtype, moe,
                                                recompute=recompute,
                                                sequence_parallel=sequence_parallel,
                                                context_parallel=cp, vpp=self.vpp,
                                                **(fusions or {}))
        # tokens per chunk of the log-prob + entropy path (None: the unchunked path)
        self.logprob_chunk_size = logprob_chunk_size
        # Under sequence parallelism every rank holds S / TP positions of the residual
        # stream, so the sequences the model sees are padded to a multiple of TP (right
        # padding: causal attention keeps it from every real token; outputs are cut back).
        # Under context parallelism every sequence is cut into 2·CP chunks (and each rank's
        # share again into TP slices under SP).
        self.seq_multiple = (tp if self.config.sequence_parallel else 1) * (2 * cp if cp > 1
                                                                              else 1)
        self.value_model = value_model
        # one GPTModel, or under a virtual pipeline a `ModelChunks` of VPP of them
        self.model = mmodel.build_model_chunks(self.args, self.config,
                                               make_vocab_size_divisible_by,
                                               value_head=value_model,
                                               transformer_impl=transformer_impl,
                                               attention_backend=attention_backend)
        if load_hf:
            reader = HFReader(model_dir)
            # A critic takes the transformer from a causal LM and starts its value head at
            # zero, or takes both from an HF critic ({Arch}ForTokenClassification, `score`).
            skip = None
            if value_model and "score.weight" not in reader.where:
                skip = lambda name: name.startswith("output_layer.")  # noqa: E731
            live.load_hf_into(self.model, self.args, reader.get, skip=skip)
        self.optimizer = None
        self.fwd_model = self.model  # the DDP wrapper on GPU, once an optimizer exists
        self.routers: list = []
        if self.args.is_moe:
            self._watch_routers()
        if trainable:
            self.optimizer = build_optimizer(self.model, optim or OptimConfig(), params_dtype)
            self.fwd_model = getattr(self.optimizer, "ddp", self.model)
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)

    @classmethod
    def from_spec(cls, spec, load_hf: bool = True) -> "MegatronWorker":
        """Build from a `ModelSpec` (megarl/cluster/spec.py: `megatron_spec(cfg, role).model`
        for the actor, ref, logp replica or critic of a run): trainable when it has an
        optimizer. `load_hf=False`: Megatron's random init, from the path's config.json alone
        (tools/bench_train.py at a real shape)."""
        return cls(spec.path, spec.tp, spec.pp, params_dtype=spec.params_dtype, load_hf=load_hf,
                   optim=spec.optim, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
                   seed=spec.seed, trainable=spec.optim is not None,
                   value_model=spec.value_model, transformer_impl=spec.transformer_impl,
                   collective_timeout_s=spec.collective_timeout_s, moe=spec.moe,
                   recompute=spec.recompute, sequence_parallel=spec.sequence_parallel,
                   context_parallel=spec.context_parallel, vpp=spec.vpp,
                   attention_backend=spec.attention_backend,
                   fusions=spec.fusions, logprob_chunk_size=spec.logprob_chunk_size)

    # ---------------------------------------------------------------- forward plumbing
    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")

    def _micro_batches(self, batch: dict, micro: "int | TokenBudget"
                       ) -> tuple[list[dict], int, int]:
        """(micro-batches, rows per micro-batch, sequence length) for the schedule.

        An int: equal micro-batches of that many rows (pipeline stages exchange fixed
        shapes); the last one is filled up with all-zero rows, whose masks are zero so no loss
        sees them. A `TokenBudget`: packed micro-batches (`_packed_micro_batches`)."""
        if isinstance(micro, TokenBudget):
            return self._pad_for_interleaving(*self._packed_micro_batches(batch, micro.max_tokens))
        n = batch["input_ids"].shape[0]
        mbs, n_micro = _split(n, micro)
        fill = n_micro * mbs - n
        dev = self._device()
        if fill:
            batch = _fill_rows(batch, fill)
        mbatches = [{k: (v[i:i + mbs].to(dev) if torch.is_tensor(v) else v)
                     for k, v in batch.items()} for i in range(0, n + fill, mbs)]
        return self._pad_for_interleaving(mbatches, mbs,
                                          self._model_len(batch["input_ids"].shape[1]))

    def _pad_for_interleaving(self, mbatches: list[dict], mbs: int, seq: int
                              ) -> tuple[list[dict], int, int]:
        """Under a virtual pipeline, Megatron's interleaved schedule runs micro-batches in
        groups of PP and refuses a count that is not a multiple of PP (a last, smaller group
        would stall the pipeline): the list is padded with filler micro-batches (all-zero
        rows, whose masks are zero, so no loss or output sees them; packed ones name row -1)
        rather than refused, since the count follows from the batch, not from a key."""
        pp = self.ps.get_pipeline_model_parallel_world_size()
        fill = -len(mbatches) % pp if self.vpp > 1 else 0
        if not fill:
            return mbatches, mbs, seq
        first = mbatches[0]
        filler = {k: (torch.zeros_like(v[:1] if "_packed" in first else v)
                      if torch.is_tensor(v) else v)
                  for k, v in first.items() if k not in ("_packed", "_rows")}
        if "_packed" in first:
            filler["_packed"] = pack(filler["input_ids"], [1],
                                     first["_packed"].input_ids.shape[1])
            filler["_rows"] = torch.tensor([-1], device=first["_rows"].device)
        return mbatches + [filler] * fill, mbs, seq

    def _model_len(self, n: int) -> int:
        """The sequence length the model runs for `n` tokens: a multiple of TP under
        sequence parallelism."""
        return -(-n // self.seq_multiple) * self.seq_multiple

    def _packed_micro_batches(self, batch: dict, max_tokens: int) -> tuple[list[dict], int, int]:
        """Rows split into micro-batches of at most `max_tokens` real tokens, balanced by
        tokens, as many on every data-parallel rank (the largest count any rank needs), each
        packed into one row. A micro-batch left without rows (a rank with fewer rows than the
        count) carries one all-zero filler row, whose masks are zero. Under pipeline
        parallelism every packed row is padded to the longest, as stages exchange fixed
        shapes. Each micro-batch keeps its rows' own tensors ([rows, S], for the loss), the
        packed row under "_packed" and the rows' indices in the batch under "_rows"."""
        lengths = row_lengths(batch)
        # the budget counts per CP rank: a micro-batch's sequences are shared by CP ranks
        k = torch.tensor([count_micro_batches(lengths, max_tokens * self.cp)],
                         device=self._device())
        if self.ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(k, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
        k = int(k.item())
        parts = balanced_partition(lengths, k)
        dev = self._device()
        filler = _fill_rows({kk: v[:0] if torch.is_tensor(v) else v for kk, v in batch.items()}, 1)
        chunks = []
        for part in parts:
            if part:
                idx = torch.tensor(part, dtype=torch.long)
                rows = {kk: (v[idx] if torch.is_tensor(v) else v) for kk, v in batch.items()}
                chunks.append((rows, idx, [lengths[j] for j in part]))
            else:
                chunks.append((filler, torch.tensor([-1]), [1]))
        equal = self._gathers_tokens()
        total = max(sum(self._segments(n)) for _, _, n in chunks) \
            if self.ps.get_pipeline_model_parallel_world_size() > 1 or equal else None
        if total is not None:
            total = self._model_len(total)
        if equal:
            # the allgather dispatcher gathers every EP rank's tokens in equal-sized parts:
            # all data-parallel ranks' packed rows take one length
            t = torch.tensor([total], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
            total = int(t.item())
        mbatches = []
        for rows, idx, n in chunks:
            mb = {kk: (v.to(dev) if torch.is_tensor(v) else v) for kk, v in rows.items()}
            # under sequence parallelism a packed row ends in a padding segment that makes
            # it a multiple of TP
            segs = self._segments(n)
            mb["_packed"] = pack(mb["input_ids"], n, total or self._model_len(sum(segs)),
                                 segs if self.cp > 1 else None)
            mb["_rows"] = idx.to(dev)
            mbatches.append(mb)
        return mbatches, 1, max(m["_packed"].input_ids.shape[1] for m in mbatches)

    def _segments(self, lengths: list[int]) -> list[int]:
        """Each sequence's segment of a packed row: itself, or under context parallelism
        padded to a multiple of 2·CP (context_parallel.py)."""
        return cpar.packed_segments(lengths, self.cp) if self.cp > 1 else list(lengths)

    def _cp_segments(self, mb: dict, seq: int) -> tuple[int, ...]:
        """The segments a micro-batch's row(s) are split over the CP ranks by."""
        packed = mb.get("_packed")
        return packed.segments if packed is not None else (seq,)

    def _cp_local(self, t: torch.Tensor, segments: tuple[int, ...], dim: int) -> torch.Tensor:
        """This CP rank's positions of `t` along `dim` (the whole sequence(s) there)."""
        idx = cpar.local_index(segments, self.cp, self.ps.get_context_parallel_rank())
        return t.index_select(dim, idx.to(t.device))

    def _run(self, batch: dict, micro: "int | TokenBudget", loss_of: Callable,
             forward_only: bool, prepared: tuple | None = None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbatches, mbs, seq = prepared or self._micro_batches(batch, micro)

        def step(data_iter, model):
            mb = next(data_iter)
            if self.routers:
                self._route_micro_batch(mb)
            packed = mb.get("_packed")
            if packed is not None:
                ids, pos = packed.input_ids, packed.position_ids
                if self.cp > 1:
                    ids, pos = (self._cp_local(t, packed.segments, 1) for t in (ids, pos))
                out = model(ids, pos, attention_mask=None, packed_seq_params=packed.params())
                return out, functools.partial(loss_of, mb)
            ids = mb["input_ids"]
            width = ids.shape[1]
            if seq > width:  # SP / CP: right padding up to a multiple of TP / 2·CP
                ids = torch.cat([ids, ids.new_zeros(ids.shape[0], seq - width)], dim=1)
            pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand_as(ids)
            if self.cp > 1:
                # this rank's chunks; the outputs stay local (the losses gather per-token
                # values, never logits: `_token_logprobs`, `_token_values`)
                ids, pos = (self._cp_local(t, (seq,), 1) for t in (ids, pos))
                mb["_seq"] = seq
            out = model(ids, pos, attention_mask=None)
            if seq > width and self.cp == 1 and live.unwrap(model).post_process:
                out = out[:, :width]  # [b, s, ...]: the padding predicts nothing
            return out, functools.partial(loss_of, mb)

        # under a virtual pipeline every chunk runs every micro-batch: one iterator each
        models = self.fwd_model if isinstance(self.fwd_model, (list, torch.nn.ModuleList)) \
            else [self.fwd_model]
        iters = [iter(mbatches) for _ in models]
        try:
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iters if len(iters) > 1 else iters[0],
                model=list(models),
                num_microbatches=len(mbatches), seq_length=seq, micro_batch_size=mbs,
                forward_only=forward_only)
        finally:
            for _, router in self.routers:
                if router.router_replay is not None:  # no replay data outlives its call
                    router.router_replay.clear_indices()
                    router.router_replay.clear_router_replay_action()

    # ---------------------------------------------------------------- mixture of experts
    def _gathers_tokens(self) -> bool:
        """Experts over EP ranks behind Megatron's allgather dispatcher (the CPU's), which
        needs the same token count on every EP rank (alltoall exchanges counts)."""
        return (self.args.is_moe and self.moe.ep > 1
                and self.config.moe_token_dispatcher_type == "allgather")

    def _watch_routers(self) -> None:
        """(global layer index, router) of this stage's MoE layers, each counting, in training
        passes, the real tokens routed to each expert (per-layer load: `moe_metrics`)."""
        self.routers = [(layer.layer_number - 1, layer.mlp.router)
                        for chunk in live.chunks(self.model) for layer in chunk.decoder.layers
                        if getattr(layer.mlp, "router", None) is not None]
        self._load: dict[int, torch.Tensor] = {}
        self._real = None  # this micro-batch's real-token mask, in the routers' token order

        def count(layer, module, _inputs, output):
            if not module.training:  # LOGP and reference passes: no metric reads them
                return
            routing_map = output[1].detach()
            if self._real is not None and self._real.numel() == routing_map.shape[0]:
                routing_map = routing_map[self._real]
            got = routing_map.sum(0, dtype=torch.float64)
            self._load[layer] = self._load.get(layer, 0) + got

        for layer, router in self.routers:
            router.register_forward_hook(functools.partial(count, layer))

    def _route_micro_batch(self, mb: dict) -> None:
        """Before a micro-batch's forward: the real-token mask in the routers' token order,
        and with routing replay (R3) each router's experts for its tokens from the batch's
        `routed_experts` [rows, S, layers, k] (the engine's choices). The routers see tokens
        as Megatron's [S, b] flattened, or a packed row's tokens back to back. Positions the
        engine never ran (padding, each sequence's last token) get experts 0..k-1: their
        outputs feed no log-prob that is used. Under sequence parallelism a router sees only
        its TP rank's slice of the (TP-padded) sequence: both are cut to it."""
        packed = mb.get("_packed")
        mask = mb.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(mb["input_ids"])
        mask = mask.bool()
        routed = mb.get("routed_experts") if self.moe.routing_replay else None
        if routed is not None:
            k = self.args.moe_topk
            if routed.shape[-1] != k or routed.shape[-2] != self.args.num_layers:
                raise ValueError(f"routed_experts: shape {tuple(routed.shape)}, the model "
                                 f"routes {self.args.num_layers} layers × top-{k}")
            spare = torch.arange(k, device=routed.device, dtype=routed.dtype)
            routed = torch.where(mask[..., None, None], routed, spare)
        if packed is not None:
            total = packed.input_ids.shape[1]
            # each sequence's tokens at its segment's start (segments longer than their
            # sequences under CP); the rest (the tail evening out stages or EP ranks, CP's
            # padding) is no real token and routes to the spare experts
            seq_segs = packed.seq_segments or packed.lengths
            starts = [0]
            for g in seq_segs[:-1]:
                starts.append(starts[-1] + g)
            where = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, packed.lengths)]
                              ).to(mask.device)
            real = torch.zeros(total, dtype=torch.bool, device=mask.device)
            real[where] = torch.cat([mask[i, :n] for i, n in enumerate(packed.lengths)])
            if routed is not None:
                flat = spare.expand(total, *routed.shape[2:]).clone()
                flat[where] = torch.cat([routed[i, :n] for i, n in enumerate(packed.lengths)])
            segs = packed.segments
            real, flat = self._sequence_shard(real, segments=segs), (
                self._sequence_shard(flat, spare, segs) if routed is not None else None)
        else:
            real = self._sequence_shard(mask.transpose(0, 1)).reshape(-1)
            if routed is not None:
                flat = self._sequence_shard(routed.transpose(0, 1), spare)
                flat = flat.reshape(-1, *routed.shape[2:])
        self._real = real
        if routed is None:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self.routers:
            replay = router.router_replay
            replay.clear_indices()
            replay.set_target_indices(flat[:, layer].long().contiguous())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _sequence_shard(self, t: torch.Tensor, fill=None, segments=None) -> torch.Tensor:
        """This rank's positions of `t` [s, ...] (the model's sequence order): padded to the
        model's length (`fill` along the new positions: False, or the spare experts), this
        CP rank's chunks of it (of each packed `segments`), and under sequence parallelism
        this TP rank's slice of those; `t` itself without SP or CP."""
        if self.seq_multiple == 1:
            return t
        s = self._model_len(t.shape[0]) if segments is None else t.shape[0]
        if s > t.shape[0]:
            pad = t.new_zeros(s - t.shape[0], *t.shape[1:])
            if fill is not None:
                pad[...] = fill
            t = torch.cat([t, pad])
        if self.cp > 1:
            t = self._cp_local(t, segments or (s,), 0)
        if not self.config.sequence_parallel:
            return t
        n = t.shape[0] // self.ps.get_tensor_model_parallel_world_size()
        r = self.ps.get_tensor_model_parallel_rank()
        return t[r * n:(r + 1) * n]

    def moe_metrics(self, micro_batches: int, prefix: str = "moe/") -> dict:
        """Per-layer expert load of the training passes since the last call (over
        `micro_batches` micro-batches): `{prefix}expert_load/layer_<i>`, the
        busiest expert's tokens over the mean (1: even; num_experts / top-k: every token on
        the same experts), its maximum over layers `{prefix}expert_load_max`, and with their
        coefficients set the load-balancing and z losses (mean over layers and micro-batches,
        unscaled). Collective over the stage's data-parallel ranks and the pipeline."""
        if not self.args.is_moe:
            return {}
        from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                             get_moe_layer_wise_logging_tracker)

        ps, dev = self.ps, self._device()
        L, E = self.args.num_layers, self.args.num_experts
        load = torch.zeros(L, E, dtype=torch.float64, device=dev)
        for layer, got in self._load.items():
            load[layer] = got
        self._load = {}
        # TP ranks saw the same tokens: count them once (under sequence parallelism each saw
        # its own slice of the sequence: all count)
        if ps.get_tensor_model_parallel_rank() != 0 and not self.config.sequence_parallel:
            load.zero_()
        tracked = sorted(get_moe_layer_wise_logging_tracker().items())
        losses = {name: entry["values"].to(dev, torch.float64) for name, entry in tracked
                  if entry["values"].shape[0] == L}
        # Megatron logs the load-balancing loss of each TP rank as its share of the layer's
        # (probabilities of its tokens against the counts over TP; the entry names the group
        # it sums over), the z loss as each rank's own mean over its tokens
        shares = {name for name, entry in tracked if entry.get("reduce_group") is not None}
        parts = torch.cat([load.flatten(), *losses.values()])
        dist.all_reduce(parts, group=ps.get_model_parallel_group())  # TP ranks and stages
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(parts, group=ps.get_data_parallel_group())
        if self.cp > 1:  # CP ranks routed their own chunks of the same rows: all count
            dist.all_reduce(parts[:L * E], group=ps.get_context_parallel_group())  # in place
        clear_aux_losses_tracker()
        load = parts[:L * E].view(L, E)
        out = {}
        for layer in range(L):
            mean = load[layer].mean()
            if mean > 0:
                out[f"{prefix}expert_load/layer_{layer}"] = float(load[layer].max() / mean)
        if out:
            out[f"{prefix}expert_load_max"] = max(out.values())
        # summed over the micro-batches, the TP ranks and the DP ranks: their mean (the TP
        # ranks' shares of a loss: their sum)
        runs = ps.get_data_parallel_world_size() * max(1, micro_batches)
        tp = ps.get_tensor_model_parallel_world_size()
        for i, name in enumerate(losses):
            vals = parts[L * E + i * L: L * E + (i + 1) * L]
            key = {"load_balancing_loss": "aux_loss"}.get(name, name)
            out[f"{prefix}{key}"] = float(vals.mean() / (runs * (1 if name in shares else tp)))
        return out

    def _token_logprobs(self, mb, logits, temperature, with_entropy):
        if self.cp > 1:
            return self._token_logprobs_cp(mb, logits, temperature, with_entropy)
        packed = mb.get("_packed")
        ids = mb["input_ids"] if packed is None else packed.input_ids
        lp, ent = token_logprobs(logits[:, :-1], ids[:, 1:], self.args.vocab_size,
                                 temperature, with_entropy, self.logprob_chunk_size)
        if packed is not None:  # back to the rows' [rows, S] layout
            width = mb["input_ids"].shape[1]
            lp = unpack_shifted(lp[0], packed.lengths, width)
            ent = unpack_shifted(ent[0], packed.lengths, width) if ent is not None else None
            return lp, ent
        pad = lp.new_zeros(ids.shape[0], 1)
        lp = torch.cat([pad, lp], dim=1)
        if ent is not None:
            ent = torch.cat([pad, ent], dim=1)
        return lp, ent

    def _cp_gather(self, mb: dict, local: torch.Tensor) -> torch.Tensor:
        """Per-position values [b, s/CP] of this CP rank -> [b, s] in sequence order, on every
        CP rank (backward: each rank its own positions; context_parallel.py)."""
        segs = self._cp_segments(mb, mb.get("_seq", 0))
        return cpar.gather_sequence(local, segs, 1, self.ps.get_context_parallel_group())

    def _token_logprobs_cp(self, mb, logits, temperature, with_entropy):
        """`_token_logprobs` under context parallelism: each rank scores its own positions
        against their next tokens (the whole row is on every rank), then the per-token
        values are gathered and laid out as without CP."""
        packed = mb.get("_packed")
        ids = mb["input_ids"] if packed is None else packed.input_ids
        segs = self._cp_segments(mb, mb.get("_seq", 0))
        full = sum(segs)
        nxt = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1 + full - ids.shape[1])], 1)
        targets = self._cp_local(nxt, segs, 1)
        lp, ent = token_logprobs(logits, targets, self.args.vocab_size, temperature,
                                 with_entropy, self.logprob_chunk_size)
        # [b, L]: position j's prediction of token j + 1
        lp = self._cp_gather(mb, lp)
        ent = self._cp_gather(mb, ent) if ent is not None else None
        width = mb["input_ids"].shape[1]
        if packed is not None:
            segs_seq = packed.seq_segments
            lp = unpack_shifted(lp[0], packed.lengths, width, segs_seq)
            ent = unpack_shifted(ent[0], packed.lengths, width, segs_seq) \
                if ent is not None else None
            return lp, ent
        pad = lp.new_zeros(ids.shape[0], 1)
        lp = torch.cat([pad, lp[:, :width - 1]], dim=1)
        ent = torch.cat([pad, ent[:, :width - 1]], dim=1) if ent is not None else None
        return lp, ent

    # ---------------------------------------------------------------- public operations
    @torch.no_grad()
    def compute_logp(self, batch: dict, temperature: float = 1.0,
                     micro_batch_size: "int | TokenBudget" = 8,
                     with_entropy: bool = False) -> dict:
        """Per-token log-probs (and entropy) for the batch; returned on every rank (CPU)."""
        self.model.eval()

        def loss_of(mb, logits):
            lp, ent = self._token_logprobs(mb, logits, temperature, with_entropy)
            out = {"logprobs": lp}
            if ent is not None:
                out["entropy"] = ent
            if "_rows" in mb:
                out["_rows"] = mb["_rows"]
            return logits.new_zeros(()), out

        store = self._run(batch, micro_batch_size, loss_of, forward_only=True)
        keys = ["logprobs"] + (["entropy"] if with_entropy else [])
        return self._gather_outputs(store, keys, batch["input_ids"].shape)

    def _gather_outputs(self, store: list[dict], keys: list[str], shape) -> dict:
        """Per-token [B, S] outputs of the last stage's micro-batches, on every rank (CPU).
        Packed micro-batches name their rows ("_rows"; -1: a filler row)."""
        B, S = shape
        result = {}
        for k in keys:
            if not self.ps.is_pipeline_last_stage():
                full = torch.empty(B, S, dtype=torch.float32, device=self._device())
            elif store and "_rows" in store[0]:
                rows = torch.cat([d["_rows"] for d in store])
                vals = torch.cat([d[k] for d in store]).float()
                keep = rows >= 0
                full = vals.new_zeros(B, S)
                full[rows[keep]] = vals[keep]
            else:
                full = torch.cat([d[k] for d in store])[:B].float()
            if self.ps.get_pipeline_model_parallel_world_size() > 1:
                dist.broadcast(full, src=self.ps.get_pipeline_model_parallel_last_rank(),
                               group=self.ps.get_pipeline_model_parallel_group())
            result[k] = full.cpu()
        return result

    def _token_values(self, out: torch.Tensor, mb: dict | None = None) -> torch.Tensor:
        """Head outputs [b, S, 1] (packed: [1, T, 1]) -> values [b, S] in token alignment
        (module doc)."""
        v = out[..., 0].float()
        packed = (mb or {}).get("_packed")
        if self.cp > 1:
            v = self._cp_gather(mb, v)
            if packed is None:
                v = v[:, :mb["input_ids"].shape[1]]
        if packed is not None:
            return unpack_shifted(v[0], packed.lengths, mb["input_ids"].shape[1],
                                  packed.seq_segments)
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)

    @torch.no_grad()
    def compute_values(self, batch: dict, micro_batch_size: "int | TokenBudget" = 8) -> dict:
        """The critic's values [B, S] (module doc), returned on every rank (CPU)."""
        if not self.value_model:
            raise RuntimeError("compute_values on a model without a value head")
        self.model.eval()

        def loss_of(mb, out):
            got = {"values": self._token_values(out, mb)}
            if "_rows" in mb:
                got["_rows"] = mb["_rows"]
            return out.new_zeros(()), got

        store = self._run(batch, micro_batch_size, loss_of, forward_only=True)
        return self._gather_outputs(store, ["values"], batch["input_ids"].shape)

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [B, S, vocab] (gathered; for tests and debugging, not training)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        self.model.eval()
        def keep(mb, logits):
            if self.cp > 1:  # whole sequences (a test's size: logits are gathered)
                logits = self._cp_gather(mb, logits)[:, :mb["input_ids"].shape[1]]
            return logits.new_zeros(()), {"logits": logits}

        store = self._run({"input_ids": input_ids}, input_ids.shape[0], keep, forward_only=True)
        B, S = input_ids.shape
        if self.ps.is_pipeline_last_stage():
            # [:B]: a virtual pipeline's filler micro-batch adds rows
            logits = torch.cat([gather_from_tensor_model_parallel_region(d["logits"])
                                for d in store])[:B]
            logits = logits[..., : self.args.vocab_size].float().contiguous()
        else:
            logits = torch.empty(B, S, self.args.vocab_size, device=self._device())
        if self.ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(logits, src=self.ps.get_pipeline_model_parallel_last_rank(),
                           group=self.ps.get_pipeline_model_parallel_group())
        return logits.cpu()

    def train_step(self, batch: dict, loss_fn: LossFn, micro_batch_size: "int | TokenBudget" = 8,
                   temperature: float = 1.0, with_entropy: bool = False,
                   max_metrics: tuple[str, ...] = ()) -> dict:
        """One optimizer step over the batch, split into micro-batches. Metrics are summed
        over micro-batches (loss_fn returns shares), except those named in `max_metrics`
        (maxima, e.g. `megarl.algo.actor_loss.MAX_METRICS`), which take the max."""
        def outputs_loss(mb, logits):
            lp, ent = self._token_logprobs(mb, logits, temperature, with_entropy)
            return loss_fn(lp, ent, mb)

        return self._train(batch, outputs_loss, micro_batch_size, max_metrics)

    def train_values(self, batch: dict, loss_fn: Callable,
                     micro_batch_size: "int | TokenBudget" = 8) -> dict:
        """One critic optimizer step: `loss_fn(values [b, S], mb) -> (loss share, metrics)`
        (e.g. `megarl.algo.value_loss.make_critic_loss`), values as in `compute_values`."""
        if not self.value_model:
            raise RuntimeError("train_values on a model without a value head")
        return self._train(batch, lambda mb, out: loss_fn(self._token_values(out, mb), mb),
                           micro_batch_size)

    def _train(self, batch: dict, outputs_loss: Callable, micro_batch_size: "int | TokenBudget",
               max_metrics: tuple[str, ...] = ()) -> dict:
        if self.optimizer is None:
            raise RuntimeError("a train step on a worker built with trainable=False")
        self.model.train()
        self.optimizer.zero_grad()
        prepared = self._micro_batches(batch, micro_batch_size)
        n_micro = len(prepared[0])

        def loss_of(mb, logits):
            loss, metrics = outputs_loss(mb, logits)
            metrics = {k: torch.as_tensor(v, dtype=torch.float32).detach().reshape(1)
                       for k, v in {"loss": loss, **metrics}.items()}
            # Megatron divides each micro-batch loss by the micro-batch count; undo it, since
            # loss_fn already returns this micro-batch's share of the batch loss.
            return loss * n_micro, metrics

        store = self._run(batch, micro_batch_size, loss_of, forward_only=False, prepared=prepared)
        stats = self._reduce_metrics(store, max_metrics)
        stats.update(self.moe_metrics(n_micro))
        stats.update(self.optimizer.step())
        stats.update(_layout_stats(batch, prepared[0], prepared[2]))
        return stats

    def _reduce_metrics(self, store: list[dict], max_metrics: tuple[str, ...] = ()) -> dict:
        """Sum the per-micro-batch metrics (they are shares of batch totals; `max_metrics`
        take the max instead) on the last stage and broadcast them to every stage."""
        names = sorted(store[0]) if store else []
        ps = self.ps
        if ps.get_pipeline_model_parallel_world_size() > 1:
            src, grp = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
            obj = [names]
            dist.broadcast_object_list(obj, src=src, group=grp)
            names = obj[0]
        def reduce(k):
            parts = [d[k].reshape(()) for d in store]
            return torch.stack(parts).max() if k in max_metrics else sum(parts)

        vals = torch.stack([reduce(k) for k in names]).cpu() \
            if ps.is_pipeline_last_stage() else torch.zeros(len(names))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(vals, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return {k: float(v) for k, v in zip(names, vals)}

    def export_hf(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This PP stage's HF-named full tensors (collective over the TP group)."""
        return live.export_hf(self.model, self.args, dtype)

    def full_hf_state(self) -> dict[str, torch.Tensor]:
        """Every HF tensor of the model on every rank (gathers over TP and PP; small models)."""
        ps = self.ps
        mine = {k: v.cpu().clone() for k, v in self.export_hf()}
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return mine
        parts = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
        # in global layer order: under a virtual pipeline each stage holds non-adjacent runs
        # of layers (the sort is stable: the order within a layer stays the export's)
        return dict(sorted(((k, v) for part in parts for k, v in part.items()),
                           key=lambda kv: _hf_layer_key(kv[0])))

    def save(self, path: str | os.PathLike, **meta) -> None:
        from .checkpoint import save_checkpoint

        if self.value_model:  # conversion and resharding rebuild a critic from this
            meta = {**meta, "value_model": True}
        save_checkpoint(self, path, **meta)

    def load(self, path: str | os.PathLike) -> dict:
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, path)
