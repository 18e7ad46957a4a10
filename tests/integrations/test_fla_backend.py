"""cuLA as a backend of FLA's registry (:mod:`cula.integrations.fla`), on the CPU with fla-core 0.6.0 (``nox -s
fla``; skipped where FLA is not installed): FLA's ``chunk_kda`` and KDA decode entry dispatch to cuLA and return
cuLA's results bit for bit, with FLA's argument names and return values; ``FLA_CULA=0`` leaves FLA's own path; every
declined call reaches FLA's own path with cuLA's reason in FLA's log; ``import cula`` registers the backend when
FLA's KDA ops are imported, in either order, without importing FLA's ops itself.

FLA's Triton kernels cannot run on a CPU, so FLA's own path is stubbed where it would launch them
(``ChunkKDAFunction`` for ``chunk_kda``, the decode kernel for ``fused_recurrent_kda_fwd``): the stub records that
FLA's path ran. cuLA's side is spied on at the Python API it calls.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

if os.environ.get("CULA_REQUIRE_FLA") == "1":  # (nox -s fla: FLA must be there; these tests never skip)
    import fla  # noqa: F401
else:
    pytest.importorskip("fla", reason="FLA is not installed here (nox -s fla runs these tests)")

# cula first, then FLA's KDA ops: the automatic registration's usual path (a program importing FLA after cula)
FLA_KDA_LOADED_BEFORE_CULA = "fla.ops.kda" in sys.modules
import cula  # noqa: E402

FLA_OPS_LOADED_BY_CULA = "fla.ops" in sys.modules
import fla.backends  # noqa: E402
from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: E402

from cula.integrations import fla as cula_fla  # noqa: E402

FLA_CHUNK = importlib.import_module("fla.ops.kda.chunk")
FLA_RECURRENT = importlib.import_module("fla.ops.kda.fused_recurrent")
FLA_LOG = "fla.backends"
B, T, H, HV, K, V = 2, 11, 1, 2, 8, 4


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def inputs(B: int = B, T: int = T, H: int = H, HV: int = HV, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=-torch.rand(B, T, HV, K, generator=gen),
                beta=torch.rand(B, T, HV, generator=gen))


def states(N: int, v_first: bool = False, HV: int = HV, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, HV, V, K, generator=gen) if v_first else torch.randn(N, HV, K, V, generator=gen)


def gate(HV: int = HV, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(A_log=0.1 * torch.randn(HV, generator=gen), dt_bias=0.1 * torch.randn(HV * K, generator=gen))


def _clone(kwargs: dict) -> dict:
    return {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict:
    """How many times the FLA backend called cuLA's Python API (by function name)."""
    calls = {"kda_prefill": 0, "kda_decode": 0}

    def spy_on(name: str):
        real = getattr(cula_fla, name)

        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return spy

    for name in calls:
        monkeypatch.setattr(cula_fla, name, spy_on(name))
    return calls


class _FlaChunkPath:
    """Stands in for FLA's ``ChunkKDAFunction`` (its Triton path): records each call, returns a marker."""

    MARK = torch.tensor([-1.0])
    calls: list = []

    @classmethod
    def apply(cls, *args):
        cls.calls.append(args)
        return cls.MARK, None


class _FlaDecodeKernel:
    """Stands in for FLA's Triton decode kernel: ``kernel[grid](...)`` records the launch and writes nothing."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append(kwargs)


@pytest.fixture
def fla_chunk_path(monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(_FlaChunkPath, "calls", [])
    monkeypatch.setattr(FLA_CHUNK, "ChunkKDAFunction", _FlaChunkPath)
    return _FlaChunkPath.calls


@pytest.fixture
def fla_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> _FlaDecodeKernel:
    kernel = _FlaDecodeKernel()
    monkeypatch.setattr(FLA_RECURRENT, "fused_recurrent_kda_fwd_kernel", kernel)
    return kernel


@pytest.fixture(autouse=True)
def _fresh_fla_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLA logs each backend's first acceptance and rejection per entry point once per process: forget them, and
    leave ``FLA_CULA`` unset (the default: enabled)."""
    monkeypatch.delenv(cula_fla.ENV_SWITCH, raising=False)
    for registry in (*fla.backends._function_registries.values(), *fla.backends._operation_registries.values()):
        registry._logged.clear()


def _registry_of_chunk_kda():
    return fla.backends._function_registries[inspect.unwrap(chunk_kda)]


def _cula_backends() -> tuple[object, object]:
    """The cula backend objects FLA holds for chunk_kda and for the "kda" operations (None where absent)."""
    chunk = _registry_of_chunk_kda()._backends.get("cula")
    ops = fla.backends._operation_registries["kda"]._backends.get("cula")
    return chunk, ops


# ---- registration --------------------------------------------------------------------------------------------------

def test_import_cula_registered_the_backend_once_fla_s_kda_ops_were_imported() -> None:
    """This module imported cula, then FLA's KDA ops: ``import cula`` imported none of FLA's ops, and the backend
    was registered right after ``fla.ops.kda`` ran, whose loader was put back."""
    assert not FLA_KDA_LOADED_BEFORE_CULA and not FLA_OPS_LOADED_BY_CULA
    chunk, ops = _cula_backends()
    assert isinstance(chunk, cula_fla.CulaBackend) and isinstance(ops, cula_fla.CulaBackend)
    assert chunk.priority == cula_fla.PRIORITY and chunk.env_var == "FLA_CULA" and chunk.is_available()
    kda_ops = sys.modules["fla.ops.kda"]
    assert type(kda_ops.__loader__).__name__ == "SourceFileLoader" and kda_ops.__spec__.loader is kda_ops.__loader__
    assert not any(type(finder).__name__ == "_AfterImport" for finder in sys.meta_path)  # (removed once used)


def test_import_cula_imports_nothing_of_fla_and_waits_for_its_kda_ops() -> None:
    """In a fresh interpreter with FLA installed: ``import cula`` leaves FLA unimported (seconds of triton and FLA
    ops) and installs the post-import hook on ``fla.ops.kda``."""
    code = textwrap.dedent(
        """
        import sys
        import cula
        assert not [m for m in sys.modules if m.split(".")[0] in ("fla", "triton")], "import cula imported FLA"
        hooks = [f.name for f in sys.meta_path if type(f).__name__ == "_AfterImport"]
        assert hooks == ["fla.ops.kda"], hooks
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_fla_s_kda_ops_already_imported_register_at_import_cula(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other order (FLA's KDA ops first, then ``import cula``): ``autoregister_fla``, which ``import cula``
    runs, registers at once."""
    for registry in (_registry_of_chunk_kda(), fla.backends._operation_registries["kda"]):
        monkeypatch.setitem(registry.__dict__, "_backends",
                            {t: b for t, b in registry._backends.items() if t != "cula"})
    assert _cula_backends() == (None, None)
    cula.integrations.autoregister_fla()
    chunk, ops = _cula_backends()
    assert isinstance(chunk, cula_fla.CulaBackend) and isinstance(ops, cula_fla.CulaBackend)


def test_register_again_replaces_the_registration() -> None:
    cula_fla.register()
    chunk, ops = _cula_backends()
    assert isinstance(chunk, cula_fla.CulaBackend) and isinstance(ops, cula_fla.CulaBackend)
    assert sum(b.backend_type == "cula" for b in fla.backends._operation_registries["kda"]._backends.values()) == 1


def test_a_failed_automatic_registration_warns_and_leaves_fla_working(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise KeyError("chunk_kda is not dispatched")

    monkeypatch.setattr(cula_fla, "register", broken)
    with pytest.warns(RuntimeWarning, match="could not register its FLA backend.*chunk_kda is not dispatched"):
        cula.integrations._register_fla_or_warn()


# ---- chunk_kda: served ---------------------------------------------------------------------------------------------

def _packed(lens: list[int], **overrides) -> dict:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kwargs = inputs(1, cu[-1], seed=4)
    kwargs.update(cu_seqlens=torch.tensor(cu, dtype=torch.int64), **overrides)
    return kwargs


# name: (FLA's chunk_kda keyword arguments, cuLA's kda_prefill keyword arguments that must give the same result)
SERVED = {}


def _served(name: str, fla_kwargs: dict, cula_overrides: dict | None = None, drop: tuple[str, ...] = ()) -> None:
    cula_kwargs = {n: x for n, x in fla_kwargs.items() if n not in drop}
    cula_kwargs.update(cula_overrides or {})
    SERVED[name] = (fla_kwargs, cula_kwargs)


_served("fixed-B2-T11", inputs())
_served("fixed-final-state-h0", dict(inputs(), initial_state=states(B), output_final_state=True))
_served("gva-H2-HV4-vfirst", dict(inputs(H=2, HV=4), initial_state=states(B, True, HV=4), output_final_state=True,
                                  state_v_first=True))
_served("gate-safe-lower-bound", dict(inputs(), use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      output_final_state=True, **gate()))
_served("gate-softplus-neg-eigval-scale", dict(inputs(), use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                               allow_neg_eigval=True, scale=0.3, **gate()))
_served("gate-lower-bound-no-A_log", dict(inputs(), use_gate_in_kernel=True, lower_bound=-2.0,
                                          dt_bias=gate()["dt_bias"]))
_packed_cu = _packed([4, 0, 7])
_served("packed-int64-cu", dict(_packed_cu, output_final_state=True),
        dict(cu_seqlens=_packed_cu["cu_seqlens"].int()))
_served("packed-int64-cu-and-cpu-copy", dict(_packed_cu, cu_seqlens_cpu=_packed_cu["cu_seqlens"].clone(),
                                             initial_state=states(3), output_final_state=True),
        dict(cu_seqlens=_packed_cu["cu_seqlens"].int(), cu_seqlens_cpu=_packed_cu["cu_seqlens"].int()))
# FLA's deprecated name of state_v_first, taken as FLA takes it
_served("gva-vfirst-by-its-deprecated-name", dict(inputs(H=2, HV=4), initial_state=states(B, True, HV=4),
                                                  output_final_state=True, transpose_state_layout=True),
        dict(state_v_first=True), drop=("transpose_state_layout",))
# what FLA ignores, cuLA ignores: the gate parameters without the in-kernel gate, its tiling and its backward
_served("ignored-gate-params-chunk-size-recompute", dict(inputs(), lower_bound=-1.0, chunk_size=32,
                                                         disable_recompute=True, max_num_seqs=4, **gate()),
        drop=("lower_bound", "chunk_size", "disable_recompute", "max_num_seqs", "A_log", "dt_bias"))


@pytest.mark.parametrize("name", list(SERVED))
def test_chunk_kda_runs_on_cula_bit_for_bit(name: str, spies: dict, fla_chunk_path: list,
                                            caplog: pytest.LogCaptureFixture) -> None:
    fla_kwargs, cula_kwargs = SERVED[name]
    caplog.set_level(logging.INFO, logger=FLA_LOG)
    with torch.no_grad():
        o, final_state = chunk_kda(**_clone(fla_kwargs))
    assert spies["kda_prefill"] == 1 and not fla_chunk_path
    assert "fla.ops.kda.chunk.chunk_kda -> cula" in caplog.text and "rejected" not in caplog.text
    o_ref, final_ref = cula.kda.kda_prefill(**_clone(cula_kwargs))
    assert o.dtype == fla_kwargs["q"].dtype and torch.equal(o, o_ref)
    if fla_kwargs.get("output_final_state"):
        assert final_state.dtype == torch.float32 and torch.equal(final_state, final_ref)
    else:
        assert final_state is None


def test_chunk_kda_with_grad_mode_on_but_nothing_requiring_grad_runs_on_cula(spies: dict) -> None:
    o, _ = chunk_kda(**inputs())
    assert spies["kda_prefill"] == 1 and torch.equal(o, cula.kda.kda_prefill(**inputs())[0])


def test_one_int64_cu_seqlens_is_narrowed_once_for_many_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's layers share one ``cu_seqlens``: its int32 copy is made once (cached as cuLA caches what it derives
    from ``cu_seqlens``: a CPU one on its values), so cuLA's own caches see one tensor; new values (written through
    .data, as through a NumPy view: no new version) make a new copy."""
    kwargs = _packed([5, 6])
    seen = []
    real = cula_fla.kda_prefill

    def capture(*args):
        seen.append(args[16])  # (kda_prefill's cu_seqlens position)
        return real(*args)

    monkeypatch.setattr(cula_fla, "kda_prefill", capture)
    with torch.no_grad():
        for _ in range(3):
            chunk_kda(**kwargs)
        kwargs["cu_seqlens"].add_(0)  # (a new version, the same values: the same copy)
        chunk_kda(**kwargs)
        kwargs["cu_seqlens"].data[1] = 6  # (new values, the same version: a write through .data)
        chunk_kda(**kwargs)
    assert len(seen) == 5 and seen[0].dtype == torch.int32 and seen[0] is seen[1] is seen[2] is seen[3]
    assert seen[4] is not seen[0] and seen[4].tolist() == [0, 6, 11]


# ---- chunk_kda: declined -------------------------------------------------------------------------------------------

# name: (FLA's chunk_kda keyword arguments, the words of cuLA's reason, the error FLA's own path raises or None)
DECLINED = {
    "requires-grad": (dict(inputs(), q=inputs()["q"].requires_grad_()), "requires grad", None),
    "intermediate-states": (dict(inputs(), return_intermediate_states=True), "return_intermediate_states", None),
    "use-graph": (dict(_packed([3, 4]), use_graph=True), "use_graph=True", None),
    "cp-context": (dict(inputs(), cp_context=types.SimpleNamespace(cu_seqlens=None, cu_seqlens_cpu=None)),
                   "cp_context", AssertionError),
    "unknown-kwarg": (dict(inputs(), head_first=False), "no equivalent of: head_first", None),
    "transpose-state-layout-and-state-v-first": (dict(inputs(), transpose_state_layout=True, state_v_first=True),
                                                  "both state_v_first and the deprecated transpose_state_layout",
                                                  ValueError),
    "bf16-initial-state": (dict(inputs(), initial_state=states(B).bfloat16()), "initial_state is not fp32",
                           AssertionError),
    "chunk-size-16": (dict(inputs(), chunk_size=16), "chunk_size=16", ValueError),
    "gate-without-A_log": (dict(inputs(), use_gate_in_kernel=True), "requires A_log", ValueError),
    "beta-of-the-qk-heads": (dict(inputs(H=1, HV=2), beta=torch.rand(B, T, 1)), "beta must have shape",
                             AssertionError),
}


@pytest.mark.parametrize("name", list(DECLINED))
def test_a_declined_chunk_kda_call_runs_fla_s_own_path_with_cula_s_reason_logged(
        name: str, spies: dict, fla_chunk_path: list, caplog: pytest.LogCaptureFixture) -> None:
    kwargs, reason, fla_error = DECLINED[name]
    caplog.set_level(logging.INFO, logger=FLA_LOG)
    if fla_error is None:
        o, _ = chunk_kda(**kwargs)
        assert o is _FlaChunkPath.MARK and len(fla_chunk_path) == 1  # FLA's own path ran
    else:  # FLA's own checks refuse the call, as they would without cuLA
        with pytest.raises(fla_error):
            chunk_kda(**kwargs)
    assert spies["kda_prefill"] == 0
    logged = [r.getMessage() for r in caplog.records if "-> cula rejected:" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0], caplog.text


def test_fla_cula_0_leaves_fla_s_own_path(monkeypatch: pytest.MonkeyPatch, spies: dict, fla_chunk_path: list) -> None:
    monkeypatch.setenv("FLA_CULA", "0")
    with torch.no_grad():
        o, _ = chunk_kda(**inputs())
    assert o is _FlaChunkPath.MARK and len(fla_chunk_path) == 1 and spies["kda_prefill"] == 0
    monkeypatch.setenv("FLA_CULA", "1")
    with torch.no_grad():
        chunk_kda(**inputs())
    assert spies["kda_prefill"] == 1 and len(fla_chunk_path) == 1


def test_fla_cula_0_leaves_fla_s_triton_path_which_cannot_run_on_a_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                        spies: dict) -> None:
    """Unstubbed: FLA's own path on CPU tensors fails in its Triton kernels (no GPU driver), cuLA is not called."""
    monkeypatch.setenv("FLA_CULA", "0")
    with torch.no_grad(), pytest.raises(Exception):  # noqa: B017  (whatever Triton raises without a GPU)
        chunk_kda(**inputs())
    assert spies["kda_prefill"] == 0


# ---- fused_recurrent_kda_fwd (FLA's KDA decode): served -----------------------------------------------------------

def _decode_inputs(B: int, T: int, seed: int = 5) -> dict:
    return inputs(B, T, seed=seed)


def _slots(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# name: (FLA's fused_recurrent_kda_fwd keyword arguments, cuLA's kda_decode keyword arguments on the same pool)
DECODE_SERVED = {
    "pool-T1-B3": (dict(_decode_inputs(3, 1), initial_state=states(6), ssm_state_indices=_slots([4, 0, 2])),
                   dict(state_indices=_slots([4, 0, 2]))),
    "pool-vfirst-by-its-deprecated-name": (dict(_decode_inputs(3, 1), initial_state=states(6, True),
                                                ssm_state_indices=_slots([4, 0, 2]), transpose_state_layout=True),
                                           dict(state_indices=_slots([4, 0, 2]), state_v_first=True)),
    "pool-T1-int64-slots-gate-vfirst": (
        dict(_decode_inputs(3, 1), initial_state=states(6, True), ssm_state_indices=_slots([1, 5, 3], torch.int64),
             state_v_first=True, use_gate_in_kernel=True, lower_bound=-3.0, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, **gate()),
        dict(state_indices=_slots([1, 5, 3]), state_v_first=True, use_gate_in_kernel=True, lower_bound=-3.0,
             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate())),
    "pool-packed-T1-int64-cu": (
        dict(_decode_inputs(1, 3), initial_state=states(4), ssm_state_indices=_slots([3, 1, 0]),
             cu_seqlens=torch.tensor([0, 1, 2, 3])),
        dict(state_indices=_slots([3, 1, 0]), cu_seqlens=torch.tensor([0, 1, 2, 3]))),
    "speculative-W3-accepted": (
        dict(_decode_inputs(2, 3), initial_state=states(8), ssm_state_indices=_slots([[0, 1, 2], [5, 6, 7]]),
             num_accepted_tokens=_slots([2, 1], torch.int64)),
        dict(state_indices=_slots([[0, 1, 2], [5, 6, 7]]), num_accepted_tokens=_slots([2, 1]))),
    "in-place-per-sequence-T4": (dict(_decode_inputs(2, 4), initial_state=states(2)),
                                 dict(state_indices=_slots([0, 1]))),
    "ignored-gate-params": (dict(_decode_inputs(3, 1), initial_state=states(3), ssm_state_indices=_slots([2, 1, 0]),
                                 lower_bound=-1.0, allow_neg_eigval=True, **gate()),
                            dict(state_indices=_slots([2, 1, 0]))),
}


@pytest.mark.parametrize("with_out", [False, True], ids=["new-o", "out"])
@pytest.mark.parametrize("name", list(DECODE_SERVED))
def test_fla_decode_runs_on_cula_in_place_bit_for_bit(name: str, with_out: bool, spies: dict,
                                                      fla_decode_kernel: _FlaDecodeKernel,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    fla_kwargs, cula_kwargs = DECODE_SERVED[name]
    fla_kwargs = _clone(fla_kwargs)
    caplog.set_level(logging.INFO, logger=FLA_LOG)
    out = torch.full_like(fla_kwargs["v"], float("nan")) if with_out else None
    pool = fla_kwargs["initial_state"]
    expected_pool = pool.clone()
    o, final_state = fused_recurrent_kda_fwd(**fla_kwargs, out=out)
    assert spies["kda_decode"] == 1 and not fla_decode_kernel.launches
    assert "kda.fused_recurrent_kda_fwd -> cula" in caplog.text
    assert final_state is pool and (out is None or o is out)
    reference = {n: fla_kwargs[n] for n in ("q", "k", "v", "g", "beta")}
    o_ref = cula.kda.kda_decode(**reference, state=expected_pool, **_clone(cula_kwargs))
    assert torch.equal(o, o_ref) and torch.equal(pool, expected_pool)


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "zeros"])
def test_fla_fused_recurrent_kda_returns_a_new_final_state_from_cula(with_h0: bool, spies: dict,
                                                                     fla_decode_kernel: _FlaDecodeKernel) -> None:
    """FLA's public ``fused_recurrent_kda`` (``inplace_final_state=False``, no indices): cuLA runs on an fp32 copy,
    ``initial_state`` is left as it was and the final state is new."""
    kwargs = dict(_packed([3, 0, 5]), **gate(), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    h0 = states(3) if with_h0 else None
    h0_before = None if h0 is None else h0.clone()
    o, final_state = fused_recurrent_kda(**_clone(kwargs), initial_state=h0, output_final_state=True)
    assert spies["kda_decode"] == 1 and not fla_decode_kernel.launches
    assert final_state.dtype == torch.float32 and final_state.shape == (3, HV, K, V)
    if h0 is not None:
        assert torch.equal(h0, h0_before) and final_state.data_ptr() != h0.data_ptr()
    pool = torch.zeros(3, HV, K, V) if h0 is None else h0_before.clone()
    o_ref = cula.kda.kda_decode(**kwargs, state=pool, state_indices=_slots([0, 1, 2]))
    assert torch.equal(o, o_ref) and torch.equal(final_state, pool)
    _, no_state = fused_recurrent_kda(**_clone(kwargs), initial_state=h0)
    assert no_state is None


def test_a_new_final_state_has_no_autograd_history(spies: dict, fla_decode_kernel: _FlaDecodeKernel) -> None:
    """``fused_recurrent_kda`` with an ``initial_state`` that requires grad: the final state cuLA returns is a new
    tensor with no history (as FLA's kernel returns it), not a copy of ``initial_state`` whose backward would hand
    ``initial_state`` an identity gradient."""
    h0 = states(2).requires_grad_()
    _, final_state = fused_recurrent_kda(**_decode_inputs(2, 1), initial_state=h0, output_final_state=True)
    assert spies["kda_decode"] == 1 and not fla_decode_kernel.launches
    assert final_state.grad_fn is None and not final_state.requires_grad


# ---- fused_recurrent_kda_fwd: declined -----------------------------------------------------------------------------

DECODE_DECLINED = {
    "slots-not-in-place": (dict(_decode_inputs(3, 1), initial_state=states(6), ssm_state_indices=_slots([4, 0, 2]),
                                inplace_final_state=False, output_final_state=True), "inplace_final_state=False"),
    "one-slot-per-sequence-T2": (dict(_decode_inputs(2, 2), initial_state=states(6), ssm_state_indices=_slots([4, 0])),
                                 "more than one token per sequence"),
    "per-channel-beta": (dict(_decode_inputs(3, 1), beta=torch.rand(3, 1, HV, V), initial_state=states(6),
                              ssm_state_indices=_slots([4, 0, 2])), "beta must have shape"),
    "fp16-pool": (dict(_decode_inputs(3, 1), initial_state=states(6).half(), ssm_state_indices=_slots([4, 0, 2])),
                  "state must have dtype"),
    "unknown-kwarg": (dict(_decode_inputs(3, 1), initial_state=states(6), ssm_state_indices=_slots([4, 0, 2]),
                           head_first=False), "no equivalent of: head_first"),
    # packed sequences of 2 and 0 tokens with [N] indices (as many tokens as sequences): FLA writes token 1's state
    # into the next sequence's slot
    "both-layout-names": (dict(_decode_inputs(3, 1), initial_state=states(6, True), ssm_state_indices=_slots([4, 0, 2]),
                               state_v_first=True, transpose_state_layout=True),
                          "both state_v_first and the deprecated transpose_state_layout"),
    "one-slot-per-sequence-packed-2-0": (dict(_decode_inputs(1, 2), initial_state=states(4),
                                              ssm_state_indices=_slots([1, 3]), cu_seqlens=torch.tensor([0, 2, 2])),
                                         "more than one token per sequence"),
    "new-state-of-another-shape": (dict(_decode_inputs(2, 1), initial_state=states(2, HV=HV + 1),
                                        inplace_final_state=False, output_final_state=True),
                                   f"one state per sequence, [N, HV, K, V]=[2, {HV}, {K}, {V}]"),
}


@pytest.mark.parametrize("name", list(DECODE_DECLINED))
def test_a_declined_fla_decode_call_runs_fla_s_kernel_with_cula_s_reason_logged(
        name: str, spies: dict, fla_decode_kernel: _FlaDecodeKernel, caplog: pytest.LogCaptureFixture) -> None:
    kwargs, reason = DECODE_DECLINED[name]
    caplog.set_level(logging.INFO, logger=FLA_LOG)
    fused_recurrent_kda_fwd(**_clone(kwargs))
    assert spies["kda_decode"] == 0 and len(fla_decode_kernel.launches) == 1
    logged = [r.getMessage() for r in caplog.records if "-> cula rejected:" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0], caplog.text


def test_fla_cula_0_leaves_fla_s_decode_kernel(monkeypatch: pytest.MonkeyPatch, spies: dict,
                                               fla_decode_kernel: _FlaDecodeKernel) -> None:
    kwargs = DECODE_SERVED["pool-T1-B3"][0]
    monkeypatch.setenv("FLA_CULA", "0")
    fused_recurrent_kda_fwd(**_clone(kwargs))
    assert spies["kda_decode"] == 0 and len(fla_decode_kernel.launches) == 1
    monkeypatch.delenv("FLA_CULA")
    fused_recurrent_kda_fwd(**_clone(kwargs))
    assert spies["kda_decode"] == 1 and len(fla_decode_kernel.launches) == 1


def _keep_decode_plan(fla_kwargs: dict, plan) -> None:
    """Keep ``plan`` as a GPU backend would for the decode call FLA's ``fla_kwargs`` make (its signature and the
    guards of its tensors), as the verifier derives that call, in the current grad mode (part of a decode
    signature: keep it in the mode the calls are made in)."""
    from cula import call_plans
    from cula.integrations import fla as cula_fla

    c, _, _ = cula_fla._decode_call(True, **fla_kwargs)
    signature = call_plans.decode_call_signature(
        c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["state_indices"], c["scale"], c["A_log"],
        c["dt_bias"], c["lower_bound"], c["use_qk_l2norm_in_kernel"], c["use_gate_in_kernel"],
        c["use_beta_sigmoid_in_kernel"], c["allow_neg_eigval"], c["state_v_first"], c["cu_seqlens"],
        c["num_accepted_tokens"], c["out"])
    guards = call_plans.tensor_guards((c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["state_indices"],
                                       c["A_log"], c["dt_bias"], c["cu_seqlens"], c["num_accepted_tokens"], c["out"]))
    call_plans.remember(signature, plan, guards)


def test_the_decode_verifier_answers_a_planned_call_from_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode call whose signature and tensors have a kept plan (a GPU backend served it) is accepted without
    cuLA's validator (FLA asks the verifier on every call: the validation would be paid twice per step); another
    call is still validated."""
    from cula import call_plans
    from cula.integrations import fla as cula_fla

    fla_kwargs = _clone(DECODE_SERVED["pool-T1-B3"][0])
    validations = []
    monkeypatch.setattr(cula_fla, "validate_kda_decode", lambda **kw: validations.append(1) or pytest.fail("asked"))
    call_plans.clear_call_plans()
    try:
        _keep_decode_plan(fla_kwargs, lambda *a: None)
        assert cula_fla.CulaBackend().fused_recurrent_kda_fwd_verifier(**fla_kwargs) == (True, None)
        assert validations == []
        other = dict(fla_kwargs, initial_state=states(7))  # (a pool of another shape: the guards refuse it)
        with pytest.raises(pytest.fail.Exception, match="asked"):
            cula_fla.CulaBackend().fused_recurrent_kda_fwd_verifier(**other)
        assert validations == [1]
    finally:
        call_plans.clear_call_plans()


@pytest.mark.parametrize("name", ["packed-int64-cu-and-cpu-copy", "gate-safe-lower-bound"])
def test_a_planned_chunk_kda_call_runs_the_plan_its_verifier_found(name: str, monkeypatch: pytest.MonkeyPatch,
                                                                   spies: dict, fla_chunk_path: list) -> None:
    """FLA asks the verifier, then calls the implementation with the same objects: a call the verifier accepted by
    its plan runs that plan (h0, A_log, dt_bias, the narrowed cu_seqlens in their places), deriving cuLA's call
    once; another call, or the implementation called alone, derives it again."""
    from cula import call_plans
    from cula.integrations import fla as cula_fla

    fla_kwargs = _clone(SERVED[name][0])
    derived, ran = [], []
    real_call = cula_fla._prefill_call
    monkeypatch.setattr(cula_fla, "_prefill_call", lambda *a, **kw: derived.append(1) or real_call(*a, **kw))
    call = real_call(**fla_kwargs)
    marker = (torch.zeros(1), None)

    def plan(q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_host):
        ran.append((q, h0, A_log, dt_bias, cu, cu_host))
        return marker

    call_plans.clear_call_plans()
    try:
        call_plans.remember(call_plans.call_signature(*call), plan)
        with torch.no_grad():
            assert chunk_kda(**fla_kwargs) is marker
        assert len(derived) == 1 and spies["kda_prefill"] == 0 and not fla_chunk_path
        [(q, h0, A_log, dt_bias, cu, cu_host)] = ran
        assert q is fla_kwargs["q"] and h0 is fla_kwargs.get("initial_state")
        assert A_log is call[14] and dt_bias is call[15] and cu is call[16]
        assert (cu_host is None) == (cu is None)
        with torch.no_grad():
            assert chunk_kda(**fla_kwargs) is marker
        assert len(derived) == 2 and len(ran) == 2, "each call verified once, its call derived once"
        backend = cula_fla.CulaBackend()
        backend.chunk_kda(**fla_kwargs)  # (the implementation alone: nothing verified just before)
        assert len(derived) == 3 and spies["kda_prefill"] == 1
    finally:
        call_plans.clear_call_plans()


def test_a_planned_fla_decode_runs_the_plan_its_verifier_found(monkeypatch: pytest.MonkeyPatch, spies: dict,
                                                               fla_decode_kernel: _FlaDecodeKernel) -> None:
    """FLA's decode entry on a pool: a call the verifier accepted by its plan runs that plan on the call's own pool
    and indices, deriving cuLA's call once; FLA's pool comes back as the final state."""
    from cula import call_plans
    from cula.integrations import fla as cula_fla

    fla_kwargs = _clone(DECODE_SERVED["pool-T1-B3"][0])
    derived, ran = [], []
    real_call = cula_fla._decode_call
    monkeypatch.setattr(cula_fla, "_decode_call", lambda *a, **kw: derived.append(1) or real_call(*a, **kw))
    marker = torch.zeros(1)

    def plan(*tensors):
        ran.append(tensors)
        return marker

    call_plans.clear_call_plans()
    try:
        with torch.no_grad():  # (the mode of the call below)
            _keep_decode_plan(fla_kwargs, plan)
        derived.clear()
        with torch.no_grad():
            o, final_state = fused_recurrent_kda_fwd(**fla_kwargs)
        assert o is marker and final_state is fla_kwargs["initial_state"]
        assert len(derived) == 1 and spies["kda_decode"] == 0 and not fla_decode_kernel.launches
        [tensors] = ran
        assert tensors[0] is fla_kwargs["q"] and tensors[5] is fla_kwargs["initial_state"]
        assert torch.equal(tensors[6], fla_kwargs["ssm_state_indices"])
    finally:
        call_plans.clear_call_plans()


def test_a_decode_onto_a_new_state_keeps_no_plan_for_the_implementation() -> None:
    """``inplace_final_state=False``: the verifier judges the call on a stand-in state (nothing copied), so even when
    a plan accepts it, the implementation must derive the call with its real new state: nothing is kept."""
    from cula import call_plans
    from cula.integrations import fla as cula_fla

    kwargs = dict(_decode_inputs(3, 1), initial_state=states(3), inplace_final_state=False, output_final_state=True)
    call_plans.clear_call_plans()
    try:
        _keep_decode_plan(kwargs, lambda *a: None)
        assert cula_fla.CulaBackend().fused_recurrent_kda_fwd_verifier(**kwargs) == (True, None)
        assert getattr(cula_fla._verified, "last", None) is None
    finally:
        call_plans.clear_call_plans()


def test_the_verified_call_is_matched_by_identity_place_and_keyword_order() -> None:
    """The implementation runs its verifier's plan only for exactly the call verified: the same objects at the same
    places and keywords; another object, another place, a missing keyword or the keywords in another order derive
    the call again (the last costs time only: FLA passes a call's keywords on in the order they came)."""
    from cula.integrations import fla as cula_fla

    a, b = torch.zeros(1), torch.zeros(1)
    call = ((a, b), {"initial_state": a, "scale": None})
    assert cula_fla._same_call(call, ((a, b), {"initial_state": a, "scale": None}))
    assert not cula_fla._same_call(call, ((a, torch.zeros(1)), {"initial_state": a, "scale": None}))
    assert not cula_fla._same_call(call, ((b, a), {"initial_state": a, "scale": None}))
    assert not cula_fla._same_call(call, ((a,), {"initial_state": a, "scale": None}))
    assert not cula_fla._same_call(call, ((a, b), {"initial_state": b, "scale": None}))
    assert not cula_fla._same_call(call, ((a, b), {"initial_state": a}))
    assert not cula_fla._same_call(call, ((a, b), {"scale": None, "initial_state": a}))


def test_int64_slots_past_int32_never_wrap_onto_another_slot() -> None:
    """FLA's int64 ``ssm_state_indices`` / ``num_accepted_tokens`` are narrowed to int32 for cuLA after a clamp to
    ``[-1, 2**31 - 1]`` (on the device: no value read): ``2**32 + 1`` stays past any pool (refused on the CPU,
    padding on a GPU) instead of wrapping to slot 1, and a value below -1 stays padding."""
    narrowed = cula_fla._int32_each_call(torch.tensor([0, 2**32 + 1, -(2**40), 3]))
    assert narrowed.dtype == torch.int32 and narrowed.tolist() == [0, 2**31 - 1, -1, 3]
    int32 = torch.tensor([5], dtype=torch.int32)
    assert cula_fla._int32_each_call(int32) is int32
