"""``cula_runtime.graph_pools.outside_graph_pools``: a no-op off CUDA; on a GPU (marked ``gpu``) the body runs on a
side stream that waits for the current one (a nested body stays on it), and the current stream waits for the body's
work. (The case it exists for, a first call inside ``torch.compile(mode="reduce-overhead")``'s warm-up, is
``tests/gpu/test_custom_ops_gpu.py``: sm90's cached fixed-length indices failed it before.)"""

from __future__ import annotations

import pytest
import torch

from cula_runtime.graph_pools import outside_graph_pools


def test_cpu_tensors_are_built_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: pytest.fail("a CPU build asked CUDA whether it is capturing"))
    with outside_graph_pools(torch.device("cpu")):
        t = torch.arange(5, dtype=torch.int32)
    assert t.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.gpu
def test_the_body_runs_on_a_side_stream_ordered_after_the_current_one() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    main = torch.cuda.current_stream(device)
    source = torch.zeros(1 << 20, device=device)
    source.add_(1)  # queued on the current stream before the build
    with outside_graph_pools(device):
        seen = torch.cuda.current_stream(device)
        with outside_graph_pools(device):  # (a nested build: on the same side stream, no second switch)
            nested = torch.cuda.current_stream(device)
        copy = source.clone()
    assert seen != main and nested == seen and torch.cuda.current_stream(device) == main
    assert torch.equal(copy.sum(), torch.tensor(float(1 << 20), device=device))
