"""Virtual pipeline (`megatron.virtual_pipeline_model_parallel_size`): the layer-offset math
against Megatron-core's own, and the checks that refuse a layout by key before any work."""
import pytest

from megarl.backends.megatron.model import ModelArgs, transformer_config, vpp_error
from megarl.config import ConfigError, load_config
from megarl.config.preflight import preflight


def layer_offset(num_layers: int, pp: int, vpp: int | None, pp_rank: int,
                 vp_stage: int = 0) -> int:
    """The layout docs/megatron_backend.md states: chunks dealt round-robin over the stages,
    chunk c of stage r holding the (c x PP + r)-th run of num_layers / (PP x VPP) layers."""
    per_chunk = num_layers // (pp * (vpp or 1))
    return (vp_stage * pp + pp_rank) * per_chunk


def _args(layers: int) -> ModelArgs:
    return ModelArgs(arch="qwen2", vocab_size=300, hidden_size=64, num_layers=layers,
                     num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                     norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                     tie_word_embeddings=True, qkv_bias=True)


@pytest.mark.parametrize("layers,pp,vpp", [(4, 2, 2), (8, 2, 2), (12, 2, 3), (8, 4, 2),
                                           (6, 3, 2), (8, 2, None)])
def test_layer_offsets_are_megatrons_and_cover_every_layer_once(layers, pp, vpp):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = transformer_config(_args(layers), 1, pp, vpp=vpp)
    seen = []
    for rank in range(pp):
        for chunk in range(vpp or 1):
            stage = chunk if vpp else None
            ours = layer_offset(layers, pp, vpp, rank, chunk)
            assert ours == get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=rank)
            n = get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=rank)
            seen += range(ours, ours + n)
    assert sorted(seen) == list(range(layers))
    if vpp:  # stage 0 holds the first run of layers and, VPP-1 runs later, its next
        assert layer_offset(layers, pp, vpp, 0, 1) == pp * layers // (pp * vpp)


def test_bad_layouts_are_refused_with_their_reason():
    assert vpp_error(4, 2, None) is None and vpp_error(4, 1, 1) is None
    assert vpp_error(8, 2, 2) is None
    assert "pipeline_model_parallel_size >= 2" in vpp_error(4, 1, 2)
    assert "num_hidden_layers=6 is not divisible by PP x VPP = 2 x 2" in vpp_error(6, 2, 2)
    assert "positive integer" in vpp_error(4, 2, 0)
    assert "context_parallel_size=2 is not supported yet" in vpp_error(8, 2, 2, cp=2)
    assert vpp_error(8, 2, 1, cp=2) is None


def test_the_worker_refuses_before_any_process_group(qwen_dir):
    import torch.distributed as dist

    from megarl.backends.megatron.worker import MegatronWorker

    with pytest.raises(ValueError, match="megatron.virtual_pipeline_model_parallel_size=2: "
                                         ".*pipeline_model_parallel_size >= 2"):
        MegatronWorker(str(qwen_dir), 1, 1, vpp=2)
    assert not dist.is_initialized()


def test_the_config_names_the_key(tmp_path, qwen_dir):
    key = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"actor_rollout_ref.model.path={qwen_dir}", f"{key}=0"])
    train = tmp_path / "t.jsonl"
    train.write_text("".join(
        f'{{"data_source": "megarl/quickstart", "reward_model": {{"ground_truth": "{i}"}}, '
        f'"prompt": [{{"role": "user", "content": "{i} + 0?"}}]}}\n' for i in range(8)))
    cfg = load_config(None, [f"actor_rollout_ref.model.path={qwen_dir}",
                             f"trainer.default_local_dir={tmp_path / 'runs'}",
                             f"data.train_files={train}", f"data.val_files={train}",
                             "trainer.n_gpus_per_node=2",
                             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                             f"{key}=2"])
    # the tiny model has 2 layers: PP 2 x VPP 2 cannot split them
    with pytest.raises(ConfigError, match=f"{key}=2: .*num_hidden_layers=2 is not divisible"):
        preflight(cfg)
