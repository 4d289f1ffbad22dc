"""A launched server sees exactly the GPUs Ray gave its replica, in Ray's order, however Ray
numbered them (`replica_devices`, the pure mapping ServerRank applies)."""
import pytest

from megarl.cluster.actors import replica_devices


@pytest.mark.parametrize("ids, visible", [
    (["5", "2", "7", "3"], "5,2,7,3"),  # not contiguous, not sorted: kept as given
    ([6, 7], "6,7"),  # contiguous, but not from 0: CUDA must not be told to count from 0
    (["GPU-1a2b", "GPU-3c4d"], "GPU-1a2b,GPU-3c4d"),  # ids that are not indices at all
])
def test_ray_gpu_ids_become_the_servers_visible_devices_as_given(ids, visible):
    assert replica_devices(ids, len(ids)) == (visible, 0)


def test_a_replica_given_too_few_or_repeated_gpus_fails_by_key():
    with pytest.raises(ValueError, match="tensor_model_parallel_size = 2 was given 1 GPU"):
        replica_devices(["4"], 2)
    with pytest.raises(ValueError, match="same GPU twice"):
        replica_devices(["4", "4"], 2)
