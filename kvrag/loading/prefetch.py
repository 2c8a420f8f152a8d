"""Background work for the feeds: a one-thread prefetcher running a few layers ahead, and CUDA side-stream
copies through pinned buffers.

Contract: `Prefetcher` produces layers in order on one worker thread, at most ``depth`` ahead of the consumer,
and raises if a layer is asked for out of order; where no core is left for that thread (the CPU, its cores all
running the model's threads: `spare_core`), it produces each layer when it is asked for instead, since a loader
thread there slows the model's threads by more than it hides. `on_stream` runs asynchronous work on a side
stream and returns an event marking its end; `consume` makes the current stream wait on that event and keeps the
tensors' memory alive for it. `DeviceCopier` uploads host layers through a ring of pinned buffers, never reusing
one before its copy finished.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def is_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device (the feeds' side-stream paths)."""
    return device.type == "cuda"


def spare_core(device: torch.device) -> bool:
    """Whether a loader thread can run beside the model without taking a core from it: always on CUDA (the model
    runs on the GPU); on the CPU when the machine has more cores than torch's threads.
    """
    return is_cuda(device) or (os.cpu_count() or 1) > torch.get_num_threads()


class Prefetcher:
    """Runs ``produce(i)`` on one worker thread, ``depth`` layers ahead of the consumer; with ``threaded`` False, in
    the consumer's thread when layer ``i`` is asked for.
    """

    def __init__(self, produce: Callable[[int], Any], n_layers: int, depth: int, threaded: bool = True) -> None:
        self._produce, self._n, self._depth = produce, n_layers, max(1, depth)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-feed") if threaded else None
        self._futures: dict[int, Future[Any]] = {}
        self._next = 0
        self._closed = False
        for _ in range(min(self._depth, n_layers) if threaded else 0):
            self._submit()

    def _submit(self) -> None:
        if self._pool is not None and self._next < self._n and not self._closed:
            self._futures[self._next] = self._pool.submit(self._produce, self._next)
            self._next += 1

    def get(self, i: int) -> Any:
        if self._pool is None:
            if i != self._next:
                raise RuntimeError(f"layer {i} was not requested in order (feeds deliver layers 0, 1, …)")
            self._next += 1
            return self._produce(i)
        future = self._futures.pop(i, None)
        if future is None:
            raise RuntimeError(f"layer {i} was not requested in order (feeds deliver layers 0, 1, …)")
        result = future.result()
        self._submit()
        return result

    def close(self) -> None:
        self._closed = True
        for future in self._futures.values():
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._futures.clear()


class DeviceCopier:
    """Copies host layers to a CUDA device on a side stream, through a ring of pinned buffers."""

    def __init__(self, device: torch.device, shape: tuple[int, ...], dtype: torch.dtype, ring: int) -> None:
        self.device, self.stream = device, copy_stream(device)
        self.host = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(ring)]
        self.events: list[torch.cuda.Event | None] = [None] * ring

    def buffer(self, i: int) -> torch.Tensor:
        """The pinned buffer for layer ``i`` (waits until its previous copy has finished)."""
        slot = i % len(self.host)
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        return self.host[slot]

    def upload(self, i: int, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        dev, event = on_stream(self.stream, lambda: host.to(self.device, non_blocking=True))
        self.events[i % len(self.host)] = event
        return dev, event


def copy_stream(device: torch.device) -> Any:
    """A side stream of the highest priority: the copies' decoding kernels are scheduled ahead of
    the blocks of fusion's long kernels still waiting for a multiprocessor, so a layer is ready
    when fusion reaches it.
    """
    return torch.cuda.Stream(device, priority=-100)  # below the device's range: its highest priority


def on_stream(stream: Any, work: Callable[[], Any]) -> tuple[Any, torch.cuda.Event]:
    """Run ``work`` (asynchronous copies) on a side CUDA stream; its result and an event marking its end."""
    with torch.cuda.stream(stream):
        result = work()
        event = torch.cuda.Event()
        event.record(stream)
    return result, event


def consume(device: torch.device, event: Any, *tensors: torch.Tensor) -> None:
    """Make the current stream wait for a side-stream copy and keep the copied memory alive for it."""
    if event is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(stream)
