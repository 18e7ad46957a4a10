"""Call plans (``cula.call_plans``): a repeated ``kda_prefill`` call skips validation and dispatch, launches exactly
what the first call launched, and still refuses everything the validator refuses. Driven on CPU tensors through the
sm90 shim and a stand-in extension (``tests/api/fake_sm90.py``), with dispatch pointed at the shim."""

from __future__ import annotations

import ctypes
import gc
import inspect
import re
import weakref

import pytest
import torch

import cula.kda
from cula import call_plans, dispatch
from cula_runtime import cute as cula_cute
from cula_runtime.env import env_snapshot, env_value
from cula_runtime.kda_args import checked_boundaries, validate_kda_prefill
from tests.kda_cases import CASES, UNBOUNDED_CASES, make_inputs

FIXED, VARLEN = "B2-T200-H2-HV4", "varlen-6seqs-GVA2-vk"


@pytest.fixture
def planned(fake_sm90, monkeypatch: pytest.MonkeyPatch):
    """(shim, fake extension, validations): ``cula.kda.kda_prefill`` dispatches to the sm90 shim, whose planner is
    registered; ``validations`` counts the validator's runs."""
    kda, fake = fake_sm90
    validations = []

    def counted(*a):
        validations.append(1)
        return validate_kda_prefill(*a)

    monkeypatch.setattr(cula.kda, "validate_kda_prefill", counted)
    monkeypatch.setattr(cula.kda, "select_backend", lambda args: kda.kda_prefill)
    monkeypatch.setattr(dispatch, "_planners", {kda.kda_prefill: kda.plan_kda_prefill})
    call_plans.clear_call_plans()
    yield kda, fake, validations
    call_plans.clear_call_plans()


def _inputs(name: str, fake, seed: int) -> dict:
    """``make_inputs`` for the named case on the CPU, with the fake extension's output sizes set."""
    case = next(c for c in CASES if c.name == name)
    kwargs = make_inputs(case, "cpu", seed=seed)
    args = validate_kda_prefill(**kwargs)
    fake.o_bytes = args.B * args.T * args.HV * 128 * 2
    fake.state_bytes = args.N * args.HV * 128 * 128 * 4
    return kwargs


def _launch_record(fake, kwargs: dict) -> tuple:
    """What the last launches passed, pointers of the call's own allocations left out: the input pointers, every
    scalar, and the index tensors' values."""
    a, r = fake.intra, fake.recurrence
    inputs = tuple(kwargs[name].data_ptr() for name in ("q", "k", "v", "g", "beta"))
    h0 = kwargs.get("initial_state")
    return (a[:5] == inputs, r[9] == (0 if h0 is None else h0.data_ptr()), a[7:9], a[12:23], a[29:31], r[10],
            r[13:21], fake.read, fake.order)


def test_signature_takes_kda_prefills_parameters() -> None:
    ours = list(inspect.signature(call_plans.call_signature).parameters)
    assert ours == list(inspect.signature(cula.kda.kda_prefill).parameters)


@pytest.mark.parametrize("name", [FIXED, VARLEN])
def test_second_call_skips_validation_and_launches_the_same(name: str, planned) -> None:
    kda, fake, validations = planned
    first = _inputs(name, fake, seed=1)
    num_chunks = 8 if name == FIXED else None
    cu = first.get("cu_seqlens")
    fake.reads = {9: (ctypes.c_int32, (cu.numel() if cu is not None else 3))}
    o1, ht1 = cula.kda.kda_prefill(**first)
    record = _launch_record(fake, first)
    assert validations == [1] and record[0] and record[1]
    second = _inputs(name, fake, seed=2)  # new tensors, one signature
    o2, ht2 = cula.kda.kda_prefill(**second)
    assert validations == [1], "the second call was validated again"
    assert _launch_record(fake, second) == record
    assert o2.data_ptr() != o1.data_ptr() and bool((o2.view(torch.uint8) == fake.O_BYTE).all())
    assert (ht1 is None) == (ht2 is None) and (ht2 is None or ht2.shape == ht1.shape)
    if num_chunks is not None:
        assert fake.intra[13] == num_chunks
    # the same launches as the shim's unplanned path on the same tensors
    kda.kda_prefill(validate_kda_prefill(**second))
    assert _launch_record(fake, second) == record


def test_a_knob_change_makes_a_new_plan_and_the_old_one_serves_again(planned, monkeypatch) -> None:
    kda, fake, validations = planned
    kwargs = _inputs(VARLEN, fake, seed=1)
    cula.kda.kda_prefill(**kwargs)
    cula.kda.kda_prefill(**kwargs)
    assert validations == [1] and fake.recurrence[18] is True  # (CULA_SM90_PDL unset: "auto", one wave)
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "0")
    cula.kda.kda_prefill(**kwargs)
    assert validations == [1, 1] and fake.recurrence[18] is False
    cula.kda.kda_prefill(**kwargs)
    assert validations == [1, 1] and fake.recurrence[18] is False
    monkeypatch.delenv(kda.ENV_PROGRAMMATIC_LAUNCH)
    cula.kda.kda_prefill(**kwargs)
    assert validations == [1, 1] and fake.recurrence[18] is True  # the first plan again
    monkeypatch.setenv(kda.ENV_INTRA_TUNED, "tensor")
    cula.kda.kda_prefill(**kwargs)
    assert validations == [1, 1, 1] and fake.intra[29] == 11
    monkeypatch.setenv(kda.ENV_INTRA_TUNED, "nope")  # a bad knob is still refused, before any launch
    fake.intra = ()
    with pytest.raises(ValueError, match="CULA_SM90_INTRA_TUNED='nope'"):
        cula.kda.kda_prefill(**kwargs)
    assert fake.intra == ()


BAD_AFTER_A_PLAN = {
    "flag-int": (dict(output_final_state=1), TypeError, "output_final_state must be a bool, got int"),
    "scale-bool": (dict(scale=True), TypeError, "scale must be a float or None"),
    "scale-negative": (dict(scale=-1.0), ValueError, "scale must be a finite positive float"),
    "lower_bound-bool": (dict(lower_bound=True), TypeError, "lower_bound must be a float or None, got bool"),
    "k-dtype": (dict(k="float32"), TypeError, "k must have the dtype of q"),
    "g-shape": (dict(g="short"), ValueError, "g must have shape"),
    "k-not-a-tensor": (dict(k="list"), TypeError, "k must be a torch.Tensor, got list"),
    "cu-decreasing": (dict(cu_seqlens="decreasing"), ValueError, "cu_seqlens must be non-decreasing"),
    "cu-cpu-bad-end": (dict(cu_seqlens_cpu="bad-end"), ValueError, "cu_seqlens_cpu: cu_seqlens[-1] must equal"),
}


def _spoil(kwargs: dict, change: dict) -> dict:
    kwargs = dict(kwargs)
    for name, value in change.items():
        if value == "float32":
            value = kwargs[name].float()
        elif value == "short":
            value = kwargs[name][:, :-1]
        elif value == "list":
            value = kwargs[name].tolist()
        elif value == "decreasing":  # same shape and dtype, new values
            value = kwargs[name].clone()
            value[2] = value[1] - 1
        elif value == "bad-end":
            value = kwargs["cu_seqlens"].clone()
            value[-1] -= 1
        kwargs[name] = value
    return kwargs


@pytest.mark.parametrize("bad", list(BAD_AFTER_A_PLAN), ids=list(BAD_AFTER_A_PLAN))
def test_a_plan_never_admits_what_the_validator_refuses(bad: str, planned) -> None:
    kda, fake, validations = planned
    kwargs = _inputs(VARLEN, fake, seed=1)
    if bad == "cu-cpu-bad-end":
        kwargs["cu_seqlens_cpu"] = kwargs["cu_seqlens"].clone()
    for _ in range(2):
        cula.kda.kda_prefill(**kwargs)
    assert validations == [1]
    change, exc, message = BAD_AFTER_A_PLAN[bad]
    fake.intra = ()
    with pytest.raises(exc, match=re.escape(message)):
        cula.kda.kda_prefill(**_spoil(kwargs, change))
    assert fake.intra == ()  # refused before any launch
    cula.kda.kda_prefill(**kwargs)  # the plan still serves the good call
    assert fake.intra != ()


def test_non_contiguous_or_subclass_inputs_are_validated_every_call(planned) -> None:
    kda, fake, validations = planned
    kwargs = _inputs(FIXED, fake, seed=1)
    wide = torch.empty(*kwargs["v"].shape[:-1], 256, dtype=kwargs["v"].dtype)
    wide[..., :128] = kwargs["v"]
    kwargs["v"] = wide[..., :128]  # a strided view: the validator copies it
    for count in (1, 2):
        cula.kda.kda_prefill(**kwargs)
        assert len(validations) == count
        assert fake.intra[2] != kwargs["v"].data_ptr()  # the kernel got the dense copy
    kwargs = _inputs(FIXED, fake, seed=1)
    kwargs["q"] = _MarkedParameter(kwargs["q"], requires_grad=False)
    for count in (3, 4):
        cula.kda.kda_prefill(**kwargs)
        assert len(validations) == count


class _MarkedParameter(torch.nn.Parameter):
    """A Parameter subclass (as engines define for their weights): the validator sees every call with one."""


def test_a_model_s_parameters_are_planned_like_plain_tensors(planned) -> None:
    """``A_log`` and ``dt_bias`` as ``nn.Parameter`` (how a model holds them, ``requires_grad`` on): the second call
    runs the first call's plan, with the parameters' own pointers."""
    kda, fake, validations = planned
    case = next(c for c in UNBOUNDED_CASES if c.name == "kimi-B1-T1000-H4")
    kwargs = make_inputs(case, "cpu", seed=2)
    args = validate_kda_prefill(**kwargs)
    fake.o_bytes = args.B * args.T * args.HV * 128 * 2
    fake.state_bytes = args.N * args.HV * 128 * 128 * 4
    assert kwargs["A_log"] is not None and kwargs["dt_bias"] is not None
    kwargs["A_log"], kwargs["dt_bias"] = (torch.nn.Parameter(kwargs[n].clone()) for n in ("A_log", "dt_bias"))
    with torch.no_grad():
        cula.kda.kda_prefill(**kwargs)
        first = _launch_record(fake, kwargs)
        fake.intra = ()
        cula.kda.kda_prefill(**kwargs)
    assert validations == [1]
    assert _launch_record(fake, kwargs) == first and kwargs["A_log"].data_ptr() in fake.intra


def test_a_plan_follows_an_in_place_update_of_cu_seqlens(planned) -> None:
    kda, fake, validations = planned
    kwargs = _inputs("varlen-0-100-100-228", fake, seed=7)
    cu = kwargs["cu_seqlens"]
    for bounds, rows in (([0, 100, 100, 228], [0, 0, 0, 1, 2, 0, 2, 1]),
                         ([0, 10, 150, 228], [0, 0, 1, 0, 1, 1, 1, 2, 2, 0, 2, 1])):
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        fake.reads = {9: (ctypes.c_int32, 4), 10: (ctypes.c_int32, len(rows))}
        cula.kda.kda_prefill(**kwargs)
        assert fake.read == {9: bounds, 10: rows}
    assert validations == [1]


def test_a_plan_holds_no_tensor_of_its_call(planned) -> None:
    kda, fake, validations = planned
    kwargs = _inputs(VARLEN, fake, seed=1)
    kwargs["cu_seqlens_cpu"] = kwargs["cu_seqlens"].clone()
    cula.kda.kda_prefill(**kwargs)
    refs = [weakref.ref(x) for x in kwargs.values() if isinstance(x, torch.Tensor)]
    del kwargs
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert len(call_plans._plans) == 1


def test_backends_without_a_planner_are_never_planned(monkeypatch) -> None:
    """The CPU reference (no planner) is validated and dispatched on every call."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    calls = []
    monkeypatch.setattr(cula.kda, "validate_kda_prefill", lambda *a: calls.append(1) or validate_kda_prefill(*a))
    kwargs = make_inputs(next(c for c in CASES if c.name == "B1-T333-H2-scale0.05"), "cpu", seed=1)
    for _ in range(2):
        cula.kda.kda_prefill(**kwargs)
    assert calls == [1, 1] and not call_plans._plans


def test_the_plan_cache_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(call_plans, "_plans", {})
    for n in range(call_plans._CAPACITY + 5):
        call_plans.remember((n,), print)
    assert 0 < len(call_plans._plans) <= call_plans._CAPACITY and call_plans.lookup((call_plans._CAPACITY + 4,))


def test_env_snapshot_sees_new_knobs_and_changed_values(monkeypatch) -> None:
    name = "CULA_TEST_SNAPSHOT_KNOB"
    monkeypatch.delenv(name, raising=False)
    before = env_snapshot()
    env_value(name, "x")
    after = env_snapshot()
    assert len(after) == len(before) + 1 and after[-1] is None
    monkeypatch.setenv(name, "1")
    assert env_snapshot() != after and env_snapshot() == env_snapshot()


# ---- the cutedsl backend's plans: the unplanned path's launches on the new call's tensors

needs_cutedsl = pytest.mark.skipif(not cula_cute.is_available(), reason="CuTeDSL or TVM-FFI is not installed")


@needs_cutedsl
@pytest.mark.parametrize("name", [FIXED, VARLEN, "B1-T300-H2-gate-precomputed", "varlen-3seqs-h0bf16-GVA4",
                                  "kimi-B1-T1000-H4", "kimi-precomputed-fp32-varlen-serving", "B2-T129-H4-HV8-vk",
                                  "B3-T130-H2-noh0"])
def test_cutedsl_plan_launches_what_the_unplanned_call_launches_on_new_tensors(name: str, monkeypatch) -> None:
    """A plan made from one call, run on a second call's tensors, launches both kernels with the configurations,
    scalars and tensors (the second call's own, or allocations of the same layout) that ``kda_prefill_cutedsl``
    gives the second call: the same bits. ``dt_bias`` in its [HV, K] form (the validator flattens it)."""
    from cula_runtime.cute.kda import backend, intra, recurrence
    from tests.cute.compile_helpers import launch_flow, record_launches

    launches = record_launches(monkeypatch)
    for module in (intra, recurrence):  # (the unplanned wrappers' CUDA-device check)
        monkeypatch.setattr(module, "check_token_tensors", lambda named, B, T: None)
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)  # (the V block's choice asks the GPU)
    case = next(c for c in [*CASES, *UNBOUNDED_CASES] if c.name == name)
    first = make_inputs(case, "cpu", seed=1)
    if "dt_bias" in first:
        first["dt_bias"] = first["dt_bias"].view(case.HV, -1)
    plan = backend.plan_kda_prefill(validate_kda_prefill(**first))
    second = make_inputs(case, "cpu", seed=2)
    if "dt_bias" in second:
        second["dt_bias"] = second["dt_bias"].view(case.HV, -1)
    order = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")
    host = None if case.cu is None else checked_boundaries(second["cu_seqlens"], None, case.T)
    launches.clear()
    o, ht = plan(*(second.get(name) for name in order), host)
    validated = validate_kda_prefill(**second)
    planned = launch_flow(list(launches), validated)
    launches.clear()
    o_ref, ht_ref = backend.kda_prefill_cutedsl(validated)
    assert [record[0].__name__ for record in planned] == ["KdaIntra", "KdaRecurrence"]
    assert planned == launch_flow(list(launches), validated)
    assert (o.shape, o.dtype) == (o_ref.shape, o_ref.dtype) and (ht is None) == (ht_ref is None)


@needs_cutedsl
def test_cutedsl_calls_are_planned_through_dispatch(monkeypatch) -> None:
    """The first call is validated, and the plan made from it runs it and every later call (no validation, no
    unplanned launch, the same two launches each); a planned call still has its boundaries checked before anything
    launches."""
    from cula_runtime.cute.kda import backend, intra, recurrence
    from tests.cute.compile_helpers import record_launches

    launches = record_launches(monkeypatch)
    for module in (intra, recurrence):
        monkeypatch.setattr(module, "check_token_tensors", lambda named, B, T: None)
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)
    unplanned, validations = [], []  # (the unplanned path's intra launch goes through intra._intra_from_raw)
    original = intra._intra_from_raw
    monkeypatch.setattr(intra, "_intra_from_raw", lambda *a, **kw: unplanned.append(1) or original(*a, **kw))
    monkeypatch.setattr(backend, "verify", lambda args: (True, "ok"))
    monkeypatch.setattr(dispatch, "_planners", {})
    monkeypatch.setenv("CULA_BACKEND", "cutedsl")
    monkeypatch.setattr(cula.kda, "validate_kda_prefill", lambda *a: validations.append(1) or validate_kda_prefill(*a))
    kwargs = make_inputs(next(c for c in CASES if c.name == VARLEN), "cpu", seed=1)
    for _ in range(3):
        o, _ = cula.kda.kda_prefill(**kwargs)
        assert o.shape == kwargs["v"].shape
    assert validations == [1] and unplanned == [] and len(launches) == 6
    assert dispatch.planner_for(backend.kda_prefill_cutedsl) is not None
    bad = kwargs["cu_seqlens"].clone()  # boundaries are checked per planned call, before the plan runs
    bad[1] = bad[2] + 1
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        cula.kda.kda_prefill(**{**kwargs, "cu_seqlens": bad})
    assert validations == [1] and len(launches) == 6


@needs_cutedsl
def test_a_cutedsl_plan_call_tvm_ffi_refuses_declines_before_any_launch(monkeypatch) -> None:
    """Where TVM-FFI refuses a planned launch (a misaligned pointer, e.g. of a pool, which no copy can stand in for),
    the plan raises ``LaunchDeclined`` with nothing launched, for ``cula.kda.kda_prefill`` to decide the call as if
    there were no plan (below); the plan's next call launches as before."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import backend, intra, recurrence

    launches: list = []
    refuse = [True]

    def compiled(kernel_cls, config, *, target=None):
        def kernel(*args):
            if refuse[0]:
                refuse[0] = False
                raise ValueError("misaligned")  # (TVM-FFI's refusal)
            launches.append((kernel_cls, config, args))
        return kernel

    monkeypatch.setattr(compile_cache, "compile_kernel", compiled)
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "_launchable", {})
    for module in (intra, recurrence):
        monkeypatch.setattr(module, "check_token_tensors", lambda named, B, T: None)
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)
    inputs = make_inputs(next(c for c in CASES if c.name == VARLEN), "cpu", seed=1)
    args = validate_kda_prefill(**inputs)
    plan = backend.plan_kda_prefill(args)
    call = (args.q, args.k, args.v, args.g, args.beta, args.initial_state, args.A_log, args.dt_bias,
            args.cu_seqlens, args.cu_seqlens_host)
    with pytest.raises(compile_cache.LaunchDeclined):
        plan(*call)
    assert launches == []
    o, ht = plan(*call)
    assert [cls.__name__ for cls, _, _ in launches] == ["KdaIntra", "KdaRecurrence"]
    assert o.shape == args.v.shape and (ht is None) == (not args.output_final_state)


def test_a_plan_that_declines_sends_the_call_to_validation_and_dispatch(planned, monkeypatch) -> None:
    """A kept prefill plan raising ``LaunchDeclined`` (nothing launched) leaves the call to the unplanned path:
    validated and dispatched as if there were no plan (the backend's runner serves it); the plan stays kept."""
    kda, fake, validations = planned
    kwargs = _inputs("varlen-0-100-100-228", fake, seed=3)
    first = cula.kda.kda_prefill(**kwargs)
    (signature, kept), = call_plans._plans.items()
    declined = []

    def declining(*a, **kw):
        declined.append(1)
        raise call_plans.LaunchDeclined

    monkeypatch.setitem(call_plans._plans, signature, declining)
    again = cula.kda.kda_prefill(**kwargs)  # (validated and dispatched; the backend's plan kept anew)
    assert declined == [1] and len(validations) == 2 and torch.equal(again[0], first[0])
    assert torch.equal(cula.kda.kda_prefill(**kwargs)[0], first[0]) and len(validations) == 2


def test_planned_varlen_calls_under_inference_mode(planned) -> None:
    """Inference-mode tensors carry no version counter (nothing derived from cu_seqlens is cached): every planned
    call checks and builds from its own cu_seqlens, and a bad one is still refused."""
    kda, fake, validations = planned
    kwargs = _inputs("varlen-0-100-100-228", fake, seed=7)
    with torch.inference_mode():
        kwargs = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
        for bounds, rows in (([0, 100, 100, 228], [0, 0, 0, 1, 2, 0, 2, 1]),
                             ([0, 10, 150, 228], [0, 0, 1, 0, 1, 1, 1, 2, 2, 0, 2, 1])):
            kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
            fake.reads = {9: (ctypes.c_int32, 4), 10: (ctypes.c_int32, len(rows))}
            cula.kda.kda_prefill(**kwargs)
            assert fake.read == {9: bounds, 10: rows}
        kwargs["cu_seqlens"] = torch.tensor([0, 150, 100, 228], dtype=torch.int32)
        with pytest.raises(ValueError, match="non-decreasing"):
            cula.kda.kda_prefill(**kwargs)
    assert validations == [1]


def test_a_knob_first_read_by_the_plans_run_does_not_cost_a_second_validation(planned, monkeypatch) -> None:
    """The plan is kept under the knobs as they are after its first run: a knob that run reads for the first time
    in the process is in the key already, so the next call is served by the plan."""
    kda, fake, validations = planned
    name = f"CULA_TEST_READ_BY_THE_PLAN_{id(validations)}"  # (a name no code has read yet in this process)
    make = kda.plan_kda_prefill

    def planner(args):
        plan = make(args)

        def reading(*tensors):
            from cula_runtime.env import env_value

            env_value(name, "")
            return plan(*tensors)

        return reading

    monkeypatch.setattr(dispatch, "_planners", {kda.kda_prefill: planner})
    kwargs = _inputs(FIXED, fake, seed=1)
    for _ in range(3):
        cula.kda.kda_prefill(**kwargs)
    assert validations == [1]


def test_plans_can_be_turned_off(planned, monkeypatch) -> None:
    kda, fake, validations = planned
    kwargs = _inputs(FIXED, fake, seed=1)
    monkeypatch.setenv(call_plans.ENV_CALL_PLANS, "0")
    for count in (1, 2, 3):
        cula.kda.kda_prefill(**kwargs)
        assert len(validations) == count
    assert not call_plans._plans
    monkeypatch.setenv(call_plans.ENV_CALL_PLANS, "1")
    for _ in range(2):
        cula.kda.kda_prefill(**kwargs)
    assert len(validations) == 4 and len(call_plans._plans) == 1


def test_a_pool_the_validator_would_refuse_to_write_is_never_served_by_a_plan(planned, monkeypatch) -> None:
    """A pool-form call's signature holds the pool's ``requires_grad`` and ``is_inference()`` and the grad and
    inference modes: after a planned call on a writable pool, a pool that requires grad (grad mode on), the same
    pool with grad mode back on after a plan made under ``no_grad``, and an inference-mode pool outside inference
    mode are each validated, and refused before anything is written."""
    kda, fake, validations = planned
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)  # (as a GPU index tensor's)

    def pool_call(pool: torch.Tensor) -> dict:
        kwargs = _inputs(FIXED, fake, seed=1)
        del kwargs["initial_state"]
        fake.state_bytes = 0
        return dict(kwargs, output_final_state=False, state=pool,
                    state_indices=torch.tensor([2, 0], dtype=torch.int32))

    shape = (4, 4, 128, 128)
    for _ in range(2):
        cula.kda.kda_prefill(**pool_call(torch.zeros(shape)))
    assert validations == [1]
    refused = torch.zeros(shape, requires_grad=True)
    with pytest.raises(ValueError, match="must not require grad while grad mode is enabled"):
        cula.kda.kda_prefill(**pool_call(refused))
    with torch.no_grad():
        cula.kda.kda_prefill(**pool_call(refused))
        cula.kda.kda_prefill(**pool_call(refused))
    with pytest.raises(ValueError, match="must not require grad while grad mode is enabled"):
        cula.kda.kda_prefill(**pool_call(refused))
    with torch.inference_mode():
        inference_pool = torch.zeros(shape)
    with pytest.raises(ValueError, match="inference-mode tensor"):
        cula.kda.kda_prefill(**pool_call(inference_pool))
    assert validations == [1, 1, 1, 1, 1]
