"""The doors benchmark's CPU logic (``benchmarks/host_doors_kda.py``): the positional form of a custom op's call and
the dispatch-only op timed beside the custom op."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cula.ops  # noqa: F401  (defines torch.ops.cula.*)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import host_doors_kda as doors  # noqa: E402


def test_positional_arguments_follow_the_schema_with_its_defaults() -> None:
    x, y = torch.zeros(1), torch.ones(1)
    args = doors._positional(torch.ops.cula.kda_decode_out.default, dict(
        q=x, k=x, v=x, g=x, beta=x, state=y, state_indices=x, out=y, use_gate_in_kernel=True, A_log=y))
    names = [a.name for a in torch.ops.cula.kda_decode_out.default._schema.arguments]
    assert len(args) == len(names) == 19
    assert args[names.index("state")] is y and args[names.index("out")] is y and args[names.index("A_log")] is y
    assert args[names.index("use_gate_in_kernel")] is True and args[names.index("scale")] is None
    assert args[names.index("use_qk_l2norm_in_kernel")] is False  # (a default)
    with pytest.raises(KeyError, match="state"):
        doors._positional(torch.ops.cula.kda_decode_out.default, dict(q=x, k=x, v=x, g=x, beta=x))


def test_the_dispatch_only_op_returns_what_it_was_given_with_the_ops_schema() -> None:
    x = torch.zeros(1, 2, 1, 4)
    beta = torch.zeros(1, 2, 1)
    first = doors._dispatch_only("kda_prefill", lambda: (x, x))
    assert first(x, x, x, x, beta, safe_gate=True)[0] is x
    second = doors._dispatch_only("kda_prefill", lambda: (x + 1, x))  # (defined once: only its result changes)
    assert second is first and float(second(x, x, x, x, beta)[0].sum()) == 8.0
    with pytest.raises(RuntimeError):  # (the schema's: an unknown keyword is refused)
        first(x, x, x, x, beta, not_an_argument=True)
