"""``cula_runtime.graph_pools.built_outside_graph_pools``: CPU builds inline; CUDA builds on a worker thread (the
routing of inductor's warm-up is per thread), ordered between the caller's current stream and a side stream; nested
and capturing builds inline; a build's exception raised to the caller. The hand-off is driven on the CPU with CUDA's
stream calls recorded; on a GPU (marked ``gpu``) a tensor built under a thread-routed memory pool is outside it
(the case it exists for, a first call inside ``torch.compile(mode="reduce-overhead")``'s warm-up, is
``tests/gpu/test_custom_ops_gpu.py``: sm90's cached fixed-length indices failed it before)."""

from __future__ import annotations

import threading

import pytest
import torch

from cula_runtime import graph_pools
from cula_runtime.graph_pools import built_outside_graph_pools


def test_cpu_tensors_are_built_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: pytest.fail("a CPU build asked CUDA whether it is capturing"))
    t = built_outside_graph_pools(torch.device("cpu"), lambda: torch.arange(5, dtype=torch.int32))
    assert t.tolist() == [0, 1, 2, 3, 4]


class _Streams:
    """CUDA's stream calls, recorded: (event, thread name) in order."""

    def __init__(self, capturing: bool = False) -> None:
        self.events: list[tuple[str, str]] = []
        self.capturing = capturing

    def note(self, what: str) -> None:
        self.events.append((what, threading.current_thread().name))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        streams = self

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_stream(self, other: Stream) -> None:
                streams.note(f"{self.name} waits for {other.name}")

        class Entered:
            def __init__(self, stream: Stream) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                streams.note(f"on {self.stream.name}")

            def __exit__(self, *exc: object) -> None:
                streams.note(f"off {self.stream.name}")

        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: streams.capturing)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream("current"))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side"))
        monkeypatch.setattr(torch.cuda, "stream", Entered)
        monkeypatch.setattr(graph_pools, "_side_streams", {})


def test_a_cuda_build_runs_on_the_worker_between_the_two_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    streams = _Streams()
    streams.install(monkeypatch)
    caller = threading.current_thread().name
    device = torch.device("cuda", 0)

    def build() -> str:
        streams.note("build")
        inner = built_outside_graph_pools(device, lambda: streams.note("nested build") or "inner")
        return f"built with {inner}"

    assert built_outside_graph_pools(device, build) == "built with inner"
    assert streams.events == [
        ("side waits for current", caller), ("on side", "cula-graph-pools"), ("build", "cula-graph-pools"),
        ("nested build", "cula-graph-pools"), ("off side", "cula-graph-pools"), ("current waits for side", caller)]


def test_a_build_during_a_capture_runs_in_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    streams = _Streams(capturing=True)
    streams.install(monkeypatch)
    assert built_outside_graph_pools(torch.device("cuda", 0), lambda: streams.note("build") or 7) == 7
    assert streams.events == [("build", threading.current_thread().name)]


def test_a_builds_exception_is_raised_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    _Streams().install(monkeypatch)

    def build() -> None:
        raise ValueError("cu_seqlens must be non-decreasing")

    with pytest.raises(ValueError, match="non-decreasing"):
        built_outside_graph_pools(torch.device("cuda", 0), build)
    assert built_outside_graph_pools(torch.device("cuda", 0), lambda: 3) == 3, "the worker serves on"


def _in_pool(pool: torch.cuda.MemPool, t: torch.Tensor) -> bool:
    return any(seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"] for seg in pool.snapshot())


@pytest.mark.gpu
def test_a_tensor_built_under_a_thread_routed_pool_is_outside_it() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.zeros(1 << 20, device=device)
    source.add_(1)  # queued on the current stream before the build
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device):  # (routes this thread's allocations, as inductor's warm-up does)
        routed = torch.empty(1 << 10, device=device)
        kept = built_outside_graph_pools(device, source.clone)
    assert _in_pool(pool, routed), "the control: an allocation of this thread lands in the pool"
    assert not _in_pool(pool, kept)
    assert torch.equal(kept.sum(), torch.tensor(float(1 << 20), device=device)), "ordered after the current stream"


@pytest.mark.gpu
def test_every_kept_tensor_of_the_backends_is_built_outside_a_routed_pool() -> None:
    """The long-lived tensors a first call keeps (Lightning's layer decay, sm90's fixed-length indices, an index
    entry of cu_seqlens), each built for the first time under a thread-routed pool: none lands in it."""
    from cula_runtime.index import prepare_chunk_indices
    from cula_runtime.lightning_args import layer_g_gamma

    device = torch.device("cuda", torch.cuda.current_device())
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32, device=device)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device):
        kept = [layer_g_gamma(7, 3, 11, device), prepare_chunk_indices(cu, 64)]
        try:
            from cula_sm90.kda import _fixed_indices
        except ImportError:
            pass
        else:
            kept += _fixed_indices(3, 129, device)
    assert not [t.shape for t in kept if _in_pool(pool, t)]


def test_a_forked_child_starts_its_own_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a fork the parent's worker thread is gone: the child's first build starts a new one (no hang)."""
    import os

    _Streams().install(monkeypatch)
    assert built_outside_graph_pools(torch.device("cuda", 0), lambda: 1) == 1  # (the parent's worker runs)
    pid = os.fork()
    if pid == 0:  # the child: a build must finish
        try:
            code = 0 if built_outside_graph_pools(torch.device("cuda", 0), lambda: 2) == 2 else 1
        except BaseException:
            code = 1
        os._exit(code)
    import signal
    import time

    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's build hung (it waited for the parent's worker thread)")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
