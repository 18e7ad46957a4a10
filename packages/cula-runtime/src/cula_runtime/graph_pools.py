"""Long-lived device tensors allocated outside CUDA-graph memory pools.

The backends keep small index tensors alive between calls (fixed-length chunk indices, varlen launch tables,
Lightning's segment tables). A first call made while ``torch.compile(mode="reduce-overhead")`` warms up a CUDA graph
runs with **the calling thread's** allocations routed to that graph's private pool (inductor's
``_use_cuda_memory_pool_manager``: ``_cuda_beginAllocateCurrentThreadToPool``, whatever the stream); a tensor cached
from there outlives the graph's outputs, and inductor refuses the graph ("tensor(s) in the cudagraph pool not tracked
as outputs"). So a cache entry is built on a worker thread of its own, whose allocations no such routing reaches, on
a side stream that waits for the caller's current stream and that the current stream then waits for.

During a stream capture itself the entry is built as before, in the caller's thread on the capturing stream (a side
stream's work would not be in the graph). A build nested in another (an index helper inside a backend's build) runs
inline on the worker. A cache miss pays one thread hand-off (tens of microseconds of host time); hits pay nothing.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["built_outside_graph_pools"]

_T = TypeVar("_T")
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_worker_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None
_on_worker = threading.local()  # .yes: this thread is the worker


def _serve(jobs: queue.SimpleQueue) -> None:
    _on_worker.yes = True
    while True:
        job, done, box = jobs.get()
        try:
            box.append((True, job()))
        except BaseException as exc:  # (handed back to the caller, raised there)
            box.append((False, exc))
        done.set()


def _forget_worker() -> None:
    """In a forked child: the parent's worker thread is not there (a new one starts on the first build)."""
    global _jobs
    _jobs = None


os.register_at_fork(after_in_child=_forget_worker)


def _worker_jobs() -> queue.SimpleQueue:
    global _jobs
    with _worker_lock:
        if _jobs is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name="cula-graph-pools", daemon=True).start()
            _jobs = jobs
        return _jobs


def built_outside_graph_pools(device: torch.device, build: Callable[[], _T]) -> _T:
    """``build()``, whose CUDA allocations (tensors to keep between calls) land outside any CUDA-graph pool.

    On a CUDA ``device`` and outside a stream capture: ``build`` runs on the worker thread, on ``device``'s side
    stream, which first waits for the caller's current stream; the current stream then waits for the side stream,
    so the tensors are ready where they are used next. Elsewhere (CPU tensors, a capture under way, a build nested in
    one on the worker) ``build`` runs where it is called. An exception of ``build`` is raised here.
    """
    if device.type != "cuda" or getattr(_on_worker, "yes", False) or torch.cuda.is_current_stream_capturing():
        return build()
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(current)

    def on_side_stream() -> _T:
        with torch.cuda.stream(side):
            return build()

    done, box = threading.Event(), []
    _worker_jobs().put((on_side_stream, done, box))
    done.wait()
    current.wait_stream(side)
    ok, value = box[0]
    if not ok:
        raise value
    return value
