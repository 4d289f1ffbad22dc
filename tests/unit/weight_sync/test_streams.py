"""The sender's stream helper and the update group's NCCL guards, on CPU.

What CPU can show: the helper is a no-op without CUDA and the same calls run (mark → send on
the side stream → wait for completion), a gloo broadcast is "complete" only when its blocking
wait has returned, and the NCCL-only paths refuse clearly where they cannot run. What only a
GPU shows (events, the side stream, aborting a communicator) is written in docs/weight_sync.md.
"""
import threading

import pytest
import torch
import torch.distributed as dist

from megarl.rollout.protocol import BadRequest
from megarl.rollout.weights import new_update_group
from megarl.utils.launch import free_port
from megarl.utils.streams import Marker, SideStream


def test_side_stream_is_a_no_op_on_cpu_and_completes_a_gloo_broadcast():
    side = SideStream("cpu")
    assert side.stream is None
    mark = side.mark_current()
    assert isinstance(mark, Marker) and mark.event is None and mark.reached()
    mark.synchronize()
    with new_update_group("127.0.0.1", free_port("127.0.0.1"), 0, 1, "streams-1",
                          "gloo", timeout_s=30) as group:
        t = torch.arange(16, dtype=torch.uint8)
        with side.after(mark):
            work = group.broadcast_async(t, 0)
        done = threading.Event()
        threading.Thread(target=lambda: (side.complete(work), done.set()), daemon=True).start()
        assert done.wait(30)
        assert (side.ordered, side.completed) == (1, 1)
        with pytest.raises(ValueError, match="abort is for NCCL"):
            group.abort()  # a gloo group is closed once its wait has ended, never aborted
        assert group.pg is not None


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_nccl_group_on_a_build_without_nccl_fails_before_the_rendezvous():
    # No peer ever joins: a check made after the rendezvous would wait out the timeout.
    with pytest.raises(BadRequest, match="nccl: this torch build has no NCCL") as e:
        new_update_group("127.0.0.1", free_port("127.0.0.1"), 0, 2, "streams-2", "nccl",
                         timeout_s=60)
    assert e.value.field == "backend"
