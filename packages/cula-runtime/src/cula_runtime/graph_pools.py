"""Long-lived device tensors allocated outside CUDA-graph memory pools.

The backends keep small index tensors alive between calls (fixed-length chunk indices, varlen launch tables,
Lightning's segment tables). A first call made while ``torch.compile(mode="reduce-overhead")`` warms up a CUDA graph
runs with the current stream's allocations routed to that graph's private pool; a tensor cached from there outlives
the graph's outputs, and inductor refuses the graph ("tensor(s) in the cudagraph pool not tracked as outputs").
Building the cache entries on a side stream keeps them in the ordinary pool: the routing filters on the stream.

During a stream capture itself the entry is built as before, on the capturing stream (a side stream's work would not
be in the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["outside_graph_pools"]

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def outside_graph_pools(device: torch.device) -> Iterator[None]:
    """Run the body, which allocates tensors to keep, with its CUDA allocations outside any CUDA-graph pool.

    On a CUDA ``device`` and outside a stream capture: the body runs on a side stream that first waits for the
    current stream, and the current stream then waits for it (so the tensors are ready where they are used next).
    Elsewhere (CPU tensors, a capture under way) the body runs as it is.
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        yield
        return
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)
