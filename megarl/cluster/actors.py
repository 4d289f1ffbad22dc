"""The per-rank worker objects: a Megatron rank, an embedded rollout server, a launched one.

Plain classes that a transport (cluster/transport.py) starts in a worker process: a Ray actor
wraps each (cluster/placement.py), or a torchrun rank builds it directly (cluster/torchrun.py).
Methods are coarse (set up, compute log-probs, train on a batch, sync weights, save, load);
their logic lives in plain modules (backends/megatron, algo, weight_sync, rollout) that tests
call without either. Each worker pins its thread budget, so CPU "devices" do not fight for
cores. Nothing here imports Ray: torchrun mode runs where it is not installed.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# Set in a torchrun rank (its node's address); a Ray worker asks Ray instead.
_TORCHRUN_NODE: str | None = None


def on_torchrun_node(address: str) -> None:
    """This process is a torchrun rank on the node other nodes reach at `address`."""
    global _TORCHRUN_NODE
    _TORCHRUN_NODE = address


def node_address() -> str:
    """The address other nodes reach this process's node at."""
    if _TORCHRUN_NODE is not None:
        return _TORCHRUN_NODE
    import ray

    return ray.util.get_node_ip_address()


def replica_devices(gpu_ids, tp_size: int) -> tuple[str, int]:
    """`CUDA_VISIBLE_DEVICES` and `--base-gpu-id` for a server on a replica's GPUs as Ray
    names them (`ray.get_gpu_ids()` of each of its devices, in the replica's order).

    Ray's ids need not be contiguous (a node's other groups hold the GPUs between them), nor
    node indices (under a node-level `CUDA_VISIBLE_DEVICES` they are its entries), so they are
    handed to CUDA as they are and the server starts from the first visible device: its TP
    ranks then take exactly these GPUs, in this order."""
    ids = [str(i) for i in gpu_ids]
    if len(ids) != tp_size:
        raise ValueError(f"a rollout replica of actor_rollout_ref.rollout."
                         f"tensor_model_parallel_size = {tp_size} was given {len(ids)} GPU(s) "
                         f"by Ray: {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"a rollout replica was given the same GPU twice by Ray: {ids}")
    return ",".join(ids), 0


def _threads(n: int) -> None:
    import torch

    n = max(1, int(n))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def _version(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


class MegatronRank:
    """One rank of a Megatron model (actor, reference or critic) in its own torch.distributed
    world.

    Under Ray `MegatronActor` (cluster/placement.py) is its shell; torchrun mode runs it
    directly in the process torchrun started."""

    def __init__(self, rank: int, world_size: int, threads: int, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        _threads(threads)
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.sync = None
        self.spec = None
        self.replica = None  # the logp group's weight receiver (serve_replica)
        # whether the live weights are still the last version synced (a refit may send them)
        self.weights_published = False

    def rendezvous(self, single_node: bool) -> tuple[str, int]:
        """Rank 0's address and a free port on its node: the world's master. One machine
        keeps every rendezvous on loopback."""
        from megarl.utils.launch import free_port

        return ("127.0.0.1" if single_node else node_address()), free_port()

    def setup(self, spec, master_addr: str, master_port: int) -> dict:
        """Build this rank's model from its `MegatronSpec` (cluster/spec.py): all it is told
        of the run."""
        from megarl.backends.megatron.worker import MegatronWorker

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.spec = spec
        self.role = spec.role
        self.worker = MegatronWorker.from_spec(spec.model)
        ps = self.worker.ps
        return {"rank": self.rank, "dp_rank": ps.get_data_parallel_rank(),
                "dp_size": ps.get_data_parallel_world_size(),
                "tp_rank": ps.get_tensor_model_parallel_rank(),
                "pp_rank": ps.get_pipeline_model_parallel_rank(),
                # where it runs, for errors that must name the host of a lost rank
                "host": node_address(), "pid": os.getpid()}

    def compute_logp(self, batch: dict, temperature: float, micro_batch_size: int,
                     with_entropy: bool = False) -> dict:
        return self.worker.compute_logp(batch, temperature, micro_batch_size, with_entropy)

    # -- the logp group's replica (logp on a group of its own) ------------------------------
    def serve_replica(self, single_node: bool, version: int) -> str:
        """Start this rank's weight receiver and return its URL: an embedded engine holding
        the actor's HF-named weights, which the trainer's weight sync feeds like any rollout
        engine (same buckets, same versions, same checksums). `version`: what the weights
        loaded now are (the HF model: the run's start, before a resumed run's first sync)."""
        from megarl.rollout.engine import EmbeddedEngine
        from megarl.rollout.server import ServerThread

        host = "127.0.0.1" if single_node else node_address()
        engine = EmbeddedEngine(self.spec.hf_path, load_tokenizer=False,
                                weight_version=str(version), max_running_requests=1)
        self.replica = ServerThread(engine, host=host).__enter__()
        self.replica_version = version  # the version the Megatron model holds
        logger.info("rank %d: logp replica receives weights at %s (version %d)", self.rank,
                    self.replica.url, version)
        return self.replica.url

    def compute_logp_at(self, batch: dict, temperature: float, micro_batch_size: int,
                        version: int, timeout_s: float) -> dict:
        """Log-probs under weight version `version` exactly: waits (at most `timeout_s`) for
        the receiver to hold it, then copies it into the Megatron model."""
        import asyncio
        import time

        engine = self.replica.engine
        deadline = time.monotonic() + timeout_s
        while _version(engine.weight_version) < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"logp replica on rank {self.rank}: weight version "
                                   f"{version} not received within {timeout_s:g} s (it holds "
                                   f"{engine.weight_version})")
            time.sleep(0.01)
        if self.replica_version != version:
            from megarl.backends.megatron.hf import live

            def copy(get, held):
                live.load_hf_into(self.worker.model, self.worker.args, get)
                return _version(held)

            self.replica_version = asyncio.run_coroutine_threadsafe(
                engine.read_weights(copy), self.replica._loop).result(timeout_s)
        if self.replica_version != version:  # a newer one landed first: never a mix
            raise RuntimeError(f"logp replica on rank {self.rank}: asked for weight version "
                               f"{version}, holds {self.replica_version}")
        return {"out": self.worker.compute_logp(batch, temperature, micro_batch_size),
                "version": self.replica_version}

    def train(self, mini_batches: list[dict], micro_batch_size: int, temperature: float,
              batch_masks: list | None = None) -> list:
        """One optimizer step per mini-batch; the loss is built here from the config.

        `batch_masks[j]`: the response mask of the whole mini-batch j (every data-parallel
        shard); the loss is normalised by its count divided by the DP size, because the
        optimizer averages gradients over the replicas. None: this shard's own count."""
        from megarl.algo.actor_loss import MAX_METRICS

        self.weights_published = False
        out = []
        loss = self.spec.actor_loss
        dp = self.worker.ps.get_data_parallel_world_size() if batch_masks is not None else 1
        for j, mb in enumerate(mini_batches):
            whole = batch_masks[j] if batch_masks is not None else mb["response_mask"]
            loss_fn = loss.make_for_batch(whole, dp, with_max_metrics=True)
            # Entropy is always computed: it is a metric even when its coefficient is 0.
            out.append(self.worker.train_step(mb, loss_fn, micro_batch_size, temperature,
                                              with_entropy=True, max_metrics=MAX_METRICS))
        return _with_peak_memory(out)

    def compute_values(self, batch: dict, micro_batch_size: int) -> dict:
        return self.worker.compute_values(batch, micro_batch_size)

    def train_critic(self, mini_batches: list[dict], micro_batch_size: int,
                     batch_masks: list) -> list:
        """One critic optimizer step per mini-batch with the clipped value loss; each rank
        normalises its shard by the whole mini-batch's mask (as `train` does)."""
        from megarl.algo.value_loss import make_critic_loss_for_batch

        c = self.spec.critic_loss
        dp = self.worker.ps.get_data_parallel_world_size()
        return [self.worker.train_values(
                    mb, make_critic_loss_for_batch(c.cliprange_value, c.loss_agg_mode, whole, dp,
                                                     c.max_response_length),
                    micro_batch_size)
                for mb, whole in zip(mini_batches, batch_masks)]

    def init_weight_sync(self, engines: list[dict], address: str) -> None:
        """`engines`: {"url", "tp", "pause"} per rollout engine (see RolloutGroup.engines)."""
        from megarl.weight_sync.trainer import TrainerWeightSync
        from megarl.weight_sync.transports import EngineLink

        links = [EngineLink(e["url"], e["tp"], e["pause"]) for e in engines]
        self.sync = TrainerWeightSync(self.worker, links, self.spec.sync, address=address)
        self.sync.connect()

    def sync_weights(self, version: int) -> dict:
        out = _sync_metrics(self.sync.sync(version))
        self.weights_published = True
        return out

    def refit_engine(self, index: int) -> dict:
        """Engine slot `index` (a replacement) gets the newest version out of band
        (`TrainerWeightSync.refit`); {} when it must wait for the next version instead."""
        stats = self.sync.refit(index, self.weights_published)
        return {} if stats is None else {"version": stats.version,
                                         "seconds": stats.blocking_s, "bytes": stats.bytes}

    def replace_engine(self, index: int, engine: dict) -> None:
        """Rollout engine `index` was replaced by `engine` ({"url", "tp", "pause"})."""
        from megarl.weight_sync.transports import EngineLink

        if self.sync is not None:
            self.sync.replace_engine(index, EngineLink(engine["url"], engine["tp"],
                                                       engine["pause"]))

    def wait_weight_sync(self) -> dict:
        return _sync_metrics(self.sync.wait() if self.sync is not None else None)

    def save(self, path: str, **meta) -> None:
        self.worker.save(path, **meta)

    def load(self, path: str) -> dict:
        self.weights_published = False
        return self.worker.load(path)

    def shutdown(self) -> None:
        from megarl.backends.megatron.parallel import destroy_distributed

        if self.sync is not None:
            self.sync.close()
        if getattr(self, "replica", None) is not None:
            self.replica.__exit__(None, None, None)
            self.replica = None
        destroy_distributed()


def _with_peak_memory(steps: list[dict]) -> list[dict]:
    """On CUDA, this process's peak allocated memory so far (`memory/trainer_peak_gib`) on
    every mini-batch's metrics; nothing on CPU."""
    import torch

    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        for s in steps:
            s["memory/trainer_peak_gib"] = peak
    return steps


def _sync_metrics(stats) -> dict:
    """`weight_sync/*` metrics of one sync (the coordinator's: it sees the whole version)."""
    if stats is None:
        return {}
    out = {"blocking_s": stats.blocking_s}
    if stats.transfer_s:
        out.update(transfer_s=stats.transfer_s, bytes=stats.bytes, buckets=stats.buckets,
                   engine_pause_s=stats.pause_s, stale_engines=len(stats.stale))
    return out


class RolloutRank:
    """An embedded rollout engine behind SGLang's HTTP API, on one device of the generate group.

    `host` is the address it binds and advertises: loopback on one machine; None, the node's
    own address, when other nodes must reach it."""

    def __init__(self, model_path: str, threads: int, seed: int, context_length: int,
                 log_level: str = "INFO", host: str | None = "127.0.0.1",
                 routed_experts: bool = False, trust_remote_code: bool = False):
        """`routed_experts`: report each token's experts (routing replay), as stock SGLang
        with `--enable-return-routed-experts`; `trust_remote_code`: the model's own code may
        run (`model.trust_remote_code`)."""
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        _threads(threads)
        from megarl.rollout.engine import EmbeddedEngine
        from megarl.rollout.server import ServerThread

        engine = EmbeddedEngine(model_path, seed=seed, context_length=context_length,
                                load_tokenizer=False, weight_version="0",
                                enable_return_routed_experts=routed_experts,
                                trust_remote_code=trust_remote_code)
        self.server = ServerThread(engine, host or node_address(), 0).__enter__()

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.__exit__(None, None, None)


class ServerRank:
    """A launched rollout server process for one rollout replica (`python -m
    sglang.launch_server`, or a module serving the same contract), started from the replica's
    first device, which the other devices of the replica serve too (`--tp-size`). It binds
    loopback on one machine, else the node's address. On CUDA under Ray it sees exactly the
    replica's GPUs (`replica_devices`); under torchrun it starts from this rank's local GPU
    (`--base-gpu-id`, counted among the node's visible devices)."""

    def __init__(self, spec, single_node: bool, cuda: bool, log_dir: str,
                 log_level: str = "INFO", gpu_ids: list | None = None):
        """`spec`: a `ServerSpec` (cluster/spec.py), all the server is told of the run.
        `gpu_ids`: Ray's ids of the replica's GPUs, in order (None: this worker's own)."""
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        import dataclasses
        from pathlib import Path

        from megarl.backends.sglang.launcher import launch_server
        from megarl.utils.launch import free_port

        host = "127.0.0.1" if single_node else node_address()
        if not cuda:
            base_gpu_id, env = None, {"CUDA_VISIBLE_DEVICES": ""}
        elif _TORCHRUN_NODE is not None:  # torchrun's local ranks are the node's devices
            base_gpu_id, env = int(os.environ.get("LOCAL_RANK", 0)), {}
        else:
            import ray

            ids = gpu_ids if gpu_ids is not None else ray.get_gpu_ids()
            visible, base_gpu_id = replica_devices(ids, spec.args.tp_size)
            env = {"CUDA_VISIBLE_DEVICES": visible}
        args = dataclasses.replace(spec.args, host=host, port=free_port(host),
                                   base_gpu_id=base_gpu_id)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.server = launch_server(args, module=spec.module, timeout_s=spec.start_timeout_s,
                                    log_path=Path(log_dir) / f"rollout-{spec.index}.log",
                                    env=env)

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.stop()
