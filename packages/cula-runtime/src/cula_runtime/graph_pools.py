"""Long-lived device tensors allocated outside CUDA-graph memory pools.

The backends keep small index tensors alive between calls (fixed-length chunk indices, varlen launch tables,
Lightning's segment tables). A first call made while ``torch.compile(mode="reduce-overhead")`` warms up a CUDA graph
runs with the current stream's allocations routed to that graph's private pool; a tensor cached from there outlives
the graph's outputs, and inductor refuses the graph ("tensor(s) in the cudagraph pool not tracked as outputs").
Building the cache entries on a side stream keeps them in the ordinary pool: the routing filters on the stream.

During a stream capture itself the entry is built as before, on the capturing stream (a side stream's work would not
be in the graph). A build nested in another (an index helper inside a backend's build) runs where the outer one put
it: one stream switch per outermost build, a few microseconds of host time on a cache miss.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["outside_graph_pools"]

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_inside = threading.local()  # .device: the device whose side stream this thread's current body runs on


@contextlib.contextmanager
def outside_graph_pools(device: torch.device) -> Iterator[None]:
    """Run the body, which allocates tensors to keep, with its CUDA allocations outside any CUDA-graph pool.

    On a CUDA ``device`` and outside a stream capture: the body runs on a side stream that first waits for the
    current stream, and the current stream then waits for it (so the tensors are ready where they are used next).
    Elsewhere (CPU tensors, a capture under way, inside such a body for the same device) the body runs as it is.
    """
    if device.type != "cuda" or getattr(_inside, "device", None) == device \
            or torch.cuda.is_current_stream_capturing():
        yield  # (nested: already on the side stream, which the outer body's exit orders before the current one)
        return
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(current)
    outer, _inside.device = getattr(_inside, "device", None), device
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        _inside.device = outer
    current.wait_stream(side)
