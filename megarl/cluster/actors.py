"""Ray actors: the thin shells around a Megatron worker rank and a rollout server.

Methods are coarse (set up, compute log-probs, train on a batch, sync weights, save, load);
their logic lives in plain modules (backends/megatron, algo, weight_sync, rollout) that tests
call without Ray. Each actor pins its thread budget, so CPU "devices" do not fight for cores.
"""
from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)


def _threads(n: int) -> None:
    import torch

    n = max(1, int(n))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


class MegatronRank:
    """One rank of a Megatron model (actor or reference) in its own torch.distributed world.

    A plain class: `MegatronActor` is its Ray shell, and torchrun mode (cluster/torchrun.py)
    runs it directly in the process torchrun started."""

    def __init__(self, rank: int, world_size: int, threads: int, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        _threads(threads)
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.sync = None
        self.cfg = None

    def rendezvous(self, single_node: bool) -> tuple[str, int]:
        """Rank 0's address and a free port on its node: the world's master. One machine
        keeps every rendezvous on loopback."""
        from megarl.utils.launch import free_port

        return ("127.0.0.1" if single_node else ray.util.get_node_ip_address()), free_port()

    def setup(self, cfg_yaml: str, role: str, master_addr: str, master_port: int) -> dict:
        from omegaconf import OmegaConf

        from megarl.backends.megatron.worker import MegatronWorker

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.cfg = OmegaConf.create(cfg_yaml)
        self.role = role
        self.worker = MegatronWorker.from_config(self.cfg, role)
        ps = self.worker.ps
        return {"rank": self.rank, "dp_rank": ps.get_data_parallel_rank(),
                "dp_size": ps.get_data_parallel_world_size(),
                "tp_rank": ps.get_tensor_model_parallel_rank(),
                "pp_rank": ps.get_pipeline_model_parallel_rank()}

    def compute_logp(self, batch: dict, temperature: float, micro_batch_size: int,
                     with_entropy: bool = False) -> dict:
        return self.worker.compute_logp(batch, temperature, micro_batch_size, with_entropy)

    def train(self, mini_batches: list[dict], micro_batch_size: int, temperature: float) -> list:
        """One optimizer step per mini-batch; the loss is built here from the config."""
        from megarl.algo.actor_loss import MAX_METRICS, make_actor_loss_from_config
        from megarl.algo.aggregate import global_denom

        out = []
        actor = self.cfg.actor_rollout_ref.actor
        for mb in mini_batches:
            denom = global_denom(mb["response_mask"], actor.loss_agg_mode)
            loss_fn = make_actor_loss_from_config(actor, denom, with_max_metrics=True)
            # Entropy is always computed: it is a metric even when its coefficient is 0.
            out.append(self.worker.train_step(mb, loss_fn, micro_batch_size, temperature,
                                              with_entropy=True, max_metrics=MAX_METRICS))
        return out

    def init_weight_sync(self, urls: list[str], address: str, base_port: int) -> None:
        from megarl.weight_sync.protocol import SyncConfig
        from megarl.weight_sync.trainer import TrainerWeightSync
        from megarl.weight_sync.transports import HTTPLink

        cfg = SyncConfig.from_rollout_config(self.cfg.actor_rollout_ref.rollout)
        self.sync = TrainerWeightSync(self.worker, [HTTPLink(u) for u in urls], cfg,
                                      address=address, base_port=base_port)
        self.sync.connect()

    def sync_weights(self, version: int) -> dict:
        stats = self.sync.sync(str(version))
        return {} if stats is None else {"blocking_s": stats.blocking_s,
                                         "transfer_s": getattr(stats, "transfer_s", 0.0) or 0.0}

    def wait_weight_sync(self) -> dict:
        stats = self.sync.wait() if self.sync is not None else None
        return {} if stats is None else {"transfer_s": stats.transfer_s}

    def save(self, path: str, **meta) -> None:
        self.worker.save(path, **meta)

    def load(self, path: str) -> dict:
        return self.worker.load(path)

    def shutdown(self) -> None:
        from megarl.backends.megatron.parallel import destroy_distributed

        if self.sync is not None:
            self.sync.close()
        destroy_distributed()


@ray.remote
class MegatronActor(MegatronRank):
    """The Ray shell of `MegatronRank`."""


class RolloutRank:
    """An embedded rollout engine behind SGLang's HTTP API, on one device of the generate group.

    `host` is the address it binds and advertises: loopback under Ray on one machine, the
    node's own address when other nodes must reach it (torchrun mode)."""

    def __init__(self, model_path: str, threads: int, seed: int, context_length: int,
                 log_level: str = "INFO", host: str = "127.0.0.1"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        _threads(threads)
        from megarl.rollout.engine import EmbeddedEngine
        from megarl.rollout.server import ServerThread

        engine = EmbeddedEngine(model_path, seed=seed, context_length=context_length,
                                load_tokenizer=False, weight_version="0")
        self.server = ServerThread(engine, host, 0).__enter__()

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.__exit__(None, None, None)


@ray.remote
class RolloutActor(RolloutRank):
    """The Ray shell of `RolloutRank`; `host=None` binds and advertises this Ray node's own
    address, which a multi-node run needs (the driver and trainers reach it from elsewhere)."""

    def __init__(self, *args, host: str | None = "127.0.0.1", **kwargs):
        super().__init__(*args, host=host or ray.util.get_node_ip_address(), **kwargs)
