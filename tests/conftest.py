"""Shared test configuration: tests marked ``gpu`` skip cleanly where no CUDA GPU is present; each test starts
without the call plans of earlier tests (``cula.call_plans``: a plan made under one test's stand-ins must not serve
another's calls)."""

from __future__ import annotations

import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_call_plans_from_earlier_tests() -> None:
    plans = sys.modules.get("cula.call_plans")  # (not imported here: the packaging tests import cula themselves)
    if plans is not None:
        plans.clear_call_plans()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

