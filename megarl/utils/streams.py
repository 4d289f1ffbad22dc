"""A side CUDA stream for work that must not queue on training's stream, and the events that
order it; on CPU every call is a no-op, so the same code runs on both.

Why it exists: under NCCL a collective's `work.wait()` does not wait for the bytes. It makes the
calling thread's *current* stream wait for NCCL's stream and returns at once; a thread that
never set a stream is on the device's default stream, which is training's. So a sender that
took "`wait()` returned" for "sent" reused buffers still being read, and made training's
stream wait on every bucket. Here the sender posts and waits on a stream of its own and learns
completion from an event it synchronises on the host. Under gloo `wait()` blocks until the
bytes are out and there is no stream: `SideStream("cpu")` does nothing and `complete` is the
plain `wait()`.

What it leaves out: the caching allocator's cross-stream bookkeeping (`record_stream`). The
sender's buffers are long-lived (snapshot and packing buffers kept between versions) and each
send is waited on before its source can be freed, so none is needed.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Marker:
    """A point in one stream's queued work (a recorded CUDA event); on CPU, always reached."""

    def __init__(self, event=None):
        self.event = event

    def synchronize(self) -> None:
        """Block the calling thread until the work before the mark has run on the device."""
        if self.event is not None:
            self.event.synchronize()

    def reached(self) -> bool:
        return self.event is None or bool(self.event.query())


class SideStream:
    """A CUDA stream of the sender's own on `device`; nothing on CPU.

    `ordered` and `completed` count the sends this helper ordered after a mark and the
    completions it waited for: the same bookkeeping runs on CPU, where tests read it."""

    def __init__(self, device: str | torch.device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # Pinned now, on the caller's thread: a thread the sender starts later is on
            # device 0 (CUDA's current device is per thread), whatever training set.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.ordered = 0
        self.completed = 0

    def mark_current(self) -> Marker:
        """A mark at the end of the work queued so far on the calling thread's current stream
        (the trainer's: the snapshot copies, a bucket's packing)."""
        if self.stream is None:
            return Marker()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return Marker(ev)

    @contextlib.contextmanager
    def after(self, mark: Marker | None) -> Iterator[None]:
        """Run the body's device work on the side stream, ordered after `mark`; a collective
        posted here has NCCL's stream wait for the side stream, never training's."""
        self.ordered += mark is not None
        if self.stream is None:
            yield
            return
        if mark is not None and mark.event is not None:
            self.stream.wait_event(mark.event)
        with torch.cuda.stream(self.stream):
            yield

    def complete(self, work) -> None:
        """Block until a posted collective has finished on the device. Under NCCL `wait()`
        only has the side stream wait for NCCL's stream (made current first, so that training's
        default stream is never the one waiting); the event recorded after it is what the
        host waits on. Raises what the collective's work raises (an aborted group, a gloo
        timeout)."""
        with self.after(None):
            work.wait()
            done = self.mark_current()
        done.synchronize()
        self.completed += 1
