"""What the custom-op tests of KDA (tests/api/test_custom_ops.py) and Lightning (tests/api/test_lightning_ops.py)
share: int32 index tensors, cloned keyword arguments (an op may write its pool in place), a tensor's metadata and an
op's outputs under fake tensors; and the call-plan tests' (test_decode_host_path.py, test_lightning_plans.py)
validator that records its calls."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def i32(values) -> torch.Tensor:
    """``values`` as a CPU int32 tensor."""
    return torch.tensor(values, dtype=torch.int32)


def clone_kwargs(kwargs: dict) -> dict:
    """``kwargs`` with every tensor cloned."""
    return {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}


def metadata(x: torch.Tensor) -> tuple:
    """What a fake output must match of the real one: shape, strides, dtype, device type."""
    return tuple(x.shape), x.stride(), x.dtype, x.device.type


def fake_outputs(op, kwargs: dict):
    """``op(**kwargs)`` with every tensor argument a fake tensor."""
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
        return op(**fake)


def counted(validate: Callable, validations: list[str]) -> Callable:
    """``validate``, appending its name to ``validations`` on every call (what a call plan must skip)."""

    def run(*args, **kwargs):
        validations.append(validate.__name__)
        return validate(*args, **kwargs)

    return run
