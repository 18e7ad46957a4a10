"""Every bad ``kda_decode`` argument, and every bad pool argument of ``kda_prefill``, raises TypeError/ValueError
naming the argument, before any backend runs (and before the pool is touched)."""

from __future__ import annotations

import inspect

import pytest
import torch

from cula.kda import kda_decode, kda_prefill
from cula_runtime.kda_decode_args import KdaDecodeArgs, validate_kda_decode

B, T, H, HV, K, V, P = 3, 2, 2, 4, 16, 8, 6


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def decode(**overrides) -> dict:
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    kwargs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=-torch.rand(B, T, HV, K, generator=gen),
                  beta=torch.rand(B, T, HV, generator=gen), state=r(P, HV, K, V), state_indices=_i32([0, 3, -1]))
    kwargs.update(overrides)
    return kwargs


def packed(**overrides) -> dict:
    base = decode()
    kwargs = {name: base[name].reshape(1, B * T, *base[name].shape[2:])[:, :4]  # 4 tokens: lengths 1, 0, 3
              for name in ("q", "k", "v", "g", "beta")}
    kwargs.update(state=base["state"], state_indices=_i32([0, 3, 5]), cu_seqlens=_i32([0, 1, 1, 4]))
    kwargs.update(overrides)
    return kwargs


def spec(**overrides) -> dict:
    kwargs = decode(state_indices=_i32([[0, 1], [-1, -1], [2, 3]]), num_accepted_tokens=_i32([2, 1, 1]))
    kwargs.update(overrides)
    return kwargs


def gate(**overrides) -> dict:
    kwargs = decode(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, K))
    kwargs.update(overrides)
    return kwargs


def aliased(kwargs: dict, name: str, of: str) -> dict:
    """``kwargs`` with argument ``name`` a view of the memory of argument ``of`` (its shape and dtype kept)."""
    shape, source = kwargs[name].shape, kwargs[of]
    return dict(kwargs, **{name: source.reshape(-1)[:shape.numel()].view(shape)})


def overlapping_pool() -> torch.Tensor:
    """A pool [P, HV, K, V] whose slots overlap: the slot stride is one head's K · V elements."""
    return torch.zeros((P + HV) * K * V).as_strided((P, HV, K, V), (K * V, K * V, V, 1))


def indices_in_the_pool() -> dict:
    """A decode whose state_indices (valid values) lie in the pool's first bytes."""
    kwargs = decode()
    indices = kwargs["state"].view(-1).view(torch.int32)[:B]
    indices.copy_(_i32([0, 3, 5]))  # (no negative index: its bits would be a NaN of the pool)
    return dict(kwargs, state_indices=indices)


def inference_tensor(*shape: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(*shape)


def inference_pool() -> torch.Tensor:
    return inference_tensor(P, HV, K, V)


BAD_DECODE = {
    # name: (kwargs, exception, words that must appear in the message)
    "q-not-tensor": (decode(q=[1.0]), TypeError, ["q", "torch.Tensor"]),
    "flag-not-bool": (decode(state_v_first=1), TypeError, ["state_v_first", "bool"]),
    "g-shape": (decode(g=-torch.rand(B, T, H, K)), ValueError, ["g", f"[{B}, {T}, {HV}, {K}]"]),
    "beta-int": (decode(beta=torch.ones(B, T, HV, dtype=torch.int64)), TypeError, ["beta", "dtype"]),
    "k-dtype-mismatch": (decode(k=torch.randn(B, T, H, K).bfloat16()), TypeError, ["k", "float32"]),
    "scale-negative": (decode(scale=-1.0), ValueError, ["scale"]),
    "state-not-tensor": (decode(state=[0.0]), TypeError, ["state", "torch.Tensor"]),
    "state-none": (decode(state=None), TypeError, ["state", "torch.Tensor", "NoneType"]),
    "state-3d": (decode(state=torch.zeros(P, HV, K)), ValueError, ["state", f"[P, {HV}, {K}, {V}]"]),
    "state-heads": (decode(state=torch.zeros(P, H, K, V)), ValueError, ["state", f"[P, {HV}, {K}, {V}]"]),
    "state-layout": (decode(state_v_first=True), ValueError, ["state", f"[P, {HV}, {V}, {K}]",
                                                              "state_v_first=True"]),
    "state-fp16": (decode(state=torch.zeros(P, HV, K, V).half()), TypeError, ["state", "dtype", "float16"]),
    "state-int": (decode(state=torch.zeros(P, HV, K, V, dtype=torch.int32)), TypeError, ["state", "dtype"]),
    "state-slots-not-dense": (decode(state=torch.zeros(P, HV, V, K).transpose(2, 3)), ValueError,
                              ["state", "dense", "never copied"]),
    "state-device": (decode(state=torch.zeros(P, HV, K, V, device="meta")), ValueError, ["state", "device"]),
    "indices-none": (decode(state_indices=None), ValueError, ["state_indices", "int32"]),
    "indices-not-tensor": (decode(state_indices=[0, 1, 2]), TypeError, ["state_indices", "torch.Tensor"]),
    "indices-int64": (decode(state_indices=torch.tensor([0, 1, 2])), TypeError, ["state_indices", "torch.int32"]),
    "indices-wrong-N": (decode(state_indices=_i32([0, 1])), ValueError, ["state_indices", f"[N]=[{B}]"]),
    "indices-3d": (decode(state_indices=_i32([[[0]], [[1]], [[2]]])), ValueError, ["state_indices", "[N, W]"]),
    "indices-zero-width": (decode(state_indices=torch.zeros(B, 0, dtype=torch.int32)), ValueError,
                           ["state_indices", "W >= 1"]),
    "indices-device": (decode(state_indices=_i32([0, 1, 2]).to("meta")), ValueError, ["state_indices", "device"]),
    "index-past-pool": (decode(state_indices=_i32([0, P, 1])), ValueError,
                        ["state_indices[1]", f"={P}", f"pool of {P} slots"]),
    "duplicate-slot": (decode(state_indices=_i32([2, -1, 2])), ValueError,
                       ["state_indices", "slot 2", "sequences 0 and 2"]),
    "duplicate-across-rows-2d": (spec(state_indices=_i32([[0, 1], [4, 5], [2, 1]]), num_accepted_tokens=None),
                                 ValueError, ["slot 1", "sequences 0 and 2"]),
    "2d-narrower-than-T": (decode(state_indices=_i32([[0], [1], [2]])), ValueError,
                           ["state_indices", f"W must be >= T={T}"]),
    "2d-entry-past-pool": (spec(state_indices=_i32([[0, 1], [-1, -1], [2, P + 3]])), ValueError,
                           ["state_indices[2, 1]", f"pool of {P} slots"]),
    "accepted-without-2d": (decode(num_accepted_tokens=_i32([1, 1, 1])), ValueError,
                            ["num_accepted_tokens", "[N, W]"]),
    "accepted-not-tensor": (spec(num_accepted_tokens=[1, 1, 1]), TypeError, ["num_accepted_tokens", "torch.Tensor"]),
    "accepted-int64": (spec(num_accepted_tokens=torch.ones(B, dtype=torch.int64)), TypeError,
                       ["num_accepted_tokens", "torch.int32"]),
    "accepted-shape": (spec(num_accepted_tokens=_i32([1, 1])), ValueError, ["num_accepted_tokens", f"[N]=[{B}]"]),
    "accepted-zero": (spec(num_accepted_tokens=_i32([0, 1, 1])), ValueError,
                      ["num_accepted_tokens[0]=0", "[1, 2]"]),
    "accepted-past-W": (spec(num_accepted_tokens=_i32([1, 1, 3])), ValueError, ["num_accepted_tokens[2]=3", "[1, 2]"]),
    "cu-float": (packed(cu_seqlens=torch.tensor([0.0, 1.0, 1.0, 4.0])), TypeError,
                 ["cu_seqlens", "torch.int32 or torch.int64"]),
    "cu-decreasing": (packed(cu_seqlens=_i32([0, 2, 1, 4])), ValueError, ["cu_seqlens", "non-decreasing"]),
    "cu-last-not-T": (packed(cu_seqlens=_i32([0, 1, 1, 3])), ValueError, ["cu_seqlens[-1]", "T=4"]),
    "cu-batch-2": (decode(cu_seqlens=_i32([0, 1, 2, 2])), ValueError, ["B must be 1"]),
    "cu-2d": (packed(cu_seqlens=_i32([[0, 4]])), ValueError, ["cu_seqlens", "1-D"]),
    "packed-longer-than-W": (packed(state_indices=_i32([[0, 1], [2, 3], [4, 5]])), ValueError,
                             ["sequence 2 has 3 tokens", "2 columns"]),
    "packed-indices-N": (packed(state_indices=_i32([0, 1])), ValueError, ["state_indices", "[N]=[3]"]),
    "lower-bound-without-gate": (decode(lower_bound=-5.0), ValueError, ["lower_bound", "use_gate_in_kernel"]),
    "lower-bound-positive": (gate(lower_bound=1.0), ValueError, ["lower_bound", "negative"]),
    "A_log-without-gate": (decode(A_log=torch.zeros(HV)), ValueError, ["A_log", "use_gate_in_kernel"]),
    "gate-without-A_log": (gate(A_log=None), ValueError, ["A_log", "lower_bound"]),
    "A_log-shape": (gate(A_log=torch.zeros(H)), ValueError, ["A_log", f"[{HV}]"]),
    "dt_bias-size": (gate(dt_bias=torch.zeros(HV)), ValueError, ["dt_bias", f"[{HV * K}]"]),
    "neg-eigval-without-sigmoid": (decode(allow_neg_eigval=True), ValueError,
                                   ["allow_neg_eigval", "use_beta_sigmoid_in_kernel"]),
    "out-not-tensor": (decode(out=[0.0]), TypeError, ["out", "torch.Tensor"]),
    "out-dtype": (decode(out=torch.zeros(B, T, HV, V).bfloat16()), TypeError, ["out", "dtype of q"]),
    "out-shape": (decode(out=torch.zeros(B, T, HV, V + 1)), ValueError, ["out", f"[{B}, {T}, {HV}, {V}]"]),
    "out-not-contiguous": (decode(out=torch.zeros(B, T, V, HV).transpose(2, 3)), ValueError, ["out", "contiguous"]),
    "out-device": (decode(out=torch.zeros(B, T, HV, V, device="meta")), ValueError, ["out", "device"]),
    # what the call writes in place owns its memory: no overlapping slots, no aliasing of another argument
    "state-slot-stride-0": (decode(state=torch.zeros(1, HV, K, V).expand(P, HV, K, V)), ValueError,
                            ["state", "must not overlap", f"{HV * K * V} elements"]),
    "state-slots-overlap": (decode(state=overlapping_pool()), ValueError, ["state", "must not overlap"]),
    "state-requires-grad": (decode(state=torch.zeros(P, HV, K, V, requires_grad=True)), ValueError,
                            ["state", "must not require grad"]),
    "state-inference-tensor": (decode(state=inference_pool()), ValueError, ["state", "inference_mode"]),
    "out-is-v": (aliased(decode(out=torch.zeros(B, T, HV, V)), "out", "v"), ValueError,
                 ["out and v share memory"]),
    "out-in-the-pool": (aliased(decode(out=torch.zeros(B, T, HV, V)), "out", "state"), ValueError,
                        ["state and out share memory"]),
    "v-in-the-pool": (aliased(decode(), "v", "state"), ValueError, ["state and v share memory", "writes state"]),
    "indices-in-the-pool": (indices_in_the_pool(), ValueError, ["state and state_indices share memory"]),
    # out is written in place too: refused before the pool is touched
    "out-requires-grad": (decode(out=torch.zeros(B, T, HV, V, requires_grad=True)), ValueError,
                          ["out", "must not require grad"]),
    "out-inference-tensor": (decode(out=inference_tensor(B, T, HV, V)), ValueError, ["out", "inference_mode"]),
    # dense tensors only; a scale past float's range is a bad value, not an OverflowError
    "q-sparse": (decode(q=decode()["q"].to_sparse()), TypeError, ["q must be a dense (strided) tensor"]),
    "out-sparse": (decode(out=torch.zeros(B, T, HV, V).to_sparse()), TypeError, ["out must be a dense"]),
    "indices-sparse": (decode(state_indices=_i32([0, 3, -1]).to_sparse()), TypeError,
                       ["state_indices must be a dense"]),
    "scale-past-float": (decode(scale=10**400), ValueError, ["scale must be a finite positive", "as a float: inf"]),
}


@pytest.mark.parametrize("case", list(BAD_DECODE), ids=list(BAD_DECODE))
def test_bad_decode_argument_is_rejected_with_its_name(case: str) -> None:
    kwargs, exc, words = BAD_DECODE[case]
    pool = kwargs["state"]
    before = pool.clone() if isinstance(pool, torch.Tensor) and pool.device.type == "cpu" else None
    with pytest.raises(exc) as info:
        kda_decode(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    if before is not None:
        assert torch.equal(pool, before)  # refused before anything was written


@pytest.mark.parametrize("make", [decode, packed, spec, gate], ids=["fixed", "packed", "spec", "gate-in-kernel"])
def test_valid_decode_arguments_pass(make) -> None:
    args = validate_kda_decode(**make())
    assert type(args) is KdaDecodeArgs and args.scale == pytest.approx(K**-0.5)
    assert (args.H, args.HV, args.K, args.V, args.P) == (H, HV, K, V, P)
    assert args.slots is not None  # CPU indices: checked on the host


def test_decode_accepts_int64_cu_seqlens_zero_lengths_and_a_strided_pool() -> None:
    kwargs = packed(cu_seqlens=torch.tensor([0, 1, 1, 4]))
    wide = torch.zeros(P, 2, HV, K, V)
    kwargs["state"] = wide[:, 0]  # the slot stride is free: slots interleaved with other data
    kwargs["state"].copy_(decode()["state"])
    args = validate_kda_decode(**kwargs)
    assert args.N == 3 and args.state is kwargs["state"] and args.slots.start == (0, 3, 5)
    kda_decode(**kwargs)
    assert torch.equal(wide[:, 1], torch.zeros_like(wide[:, 1]))  # the other data untouched


def test_decode_forwards_its_arguments_to_the_validator() -> None:
    """kda_decode and validate_kda_decode take the same parameters, with the same defaults."""
    ours = inspect.signature(kda_decode).parameters
    theirs = inspect.signature(validate_kda_decode).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.values()]


# ---- kda_prefill's pool arguments


def prefill(**overrides) -> dict:
    gen = torch.Generator().manual_seed(1)
    Tp = 20
    kwargs = dict(q=torch.randn(B, Tp, H, K, generator=gen), k=torch.randn(B, Tp, H, K, generator=gen),
                  v=torch.randn(B, Tp, HV, V, generator=gen), g=-torch.rand(B, Tp, HV, K, generator=gen),
                  beta=torch.rand(B, Tp, HV, generator=gen), state=torch.randn(P, HV, K, V, generator=gen),
                  state_indices=_i32([1, -1, 4]))
    kwargs.update(overrides)
    return kwargs


BAD_PREFILL = {
    "state-with-initial-state": (prefill(initial_state=torch.zeros(B, HV, K, V)), ValueError,
                                 ["initial_state and state are exclusive"]),
    "state-with-output-final-state": (prefill(output_final_state=True), ValueError,
                                      ["output_final_state=True and state are exclusive"]),
    "state-without-indices": (prefill(state_indices=None), ValueError, ["state", "needs state_indices"]),
    "indices-without-state": (prefill(state=None), ValueError, ["state_indices is only used with state"]),
    "has-initial-without-state": (prefill(state=None, state_indices=None, has_initial_state=torch.ones(B).bool()),
                                  ValueError, ["has_initial_state is only used with state"]),
    "has-initial-int": (prefill(has_initial_state=torch.ones(B, dtype=torch.int32)), TypeError,
                        ["has_initial_state", "torch.bool"]),
    "has-initial-shape": (prefill(has_initial_state=torch.ones(B + 1).bool()), ValueError,
                          ["has_initial_state", f"[{B}]"]),
    "has-initial-device": (prefill(has_initial_state=torch.ones(B, device="meta").bool()), ValueError,
                           ["has_initial_state", "device"]),
    "indices-2d": (prefill(state_indices=_i32([[1], [2], [3]])), ValueError,
                   ["state_indices", f"[N]=[{B}] (one slot per sequence)"]),
    "indices-int64": (prefill(state_indices=torch.tensor([0, 1, 2])), TypeError, ["state_indices", "torch.int32"]),
    "index-past-pool": (prefill(state_indices=_i32([1, P + 1, 2])), ValueError, ["state_indices[1]", "outside"]),
    "duplicate-slot": (prefill(state_indices=_i32([3, 3, -1])), ValueError, ["slot 3", "sequences 0 and 1"]),
    "state-fp16": (prefill(state=torch.zeros(P, HV, K, V).half()), TypeError, ["state", "dtype"]),
    "state-shape": (prefill(state=torch.zeros(P, HV, V, K + 1)), ValueError, ["state", f"[P, {HV}, {K}, {V}]"]),
    "state-device": (prefill(state=torch.zeros(P, HV, K, V, device="meta")), ValueError, ["state", "device"]),
    "state-slot-stride-0": (prefill(state=torch.zeros(1, HV, K, V).expand(P, HV, K, V)), ValueError,
                            ["state", "must not overlap"]),
    "state-slots-overlap": (prefill(state=overlapping_pool()), ValueError, ["state", "must not overlap"]),
    "state-requires-grad": (prefill(state=torch.zeros(P, HV, K, V, requires_grad=True)), ValueError,
                            ["state", "must not require grad"]),
    "q-in-the-pool": (aliased(prefill(state=torch.zeros(2 * B * 20 * H * K // (HV * K * V) + P, HV, K, V)), "q",
                              "state"), ValueError, ["state and q share memory"]),
}


@pytest.mark.parametrize("case", list(BAD_PREFILL), ids=list(BAD_PREFILL))
def test_bad_prefill_pool_argument_is_rejected_with_its_name(case: str) -> None:
    kwargs, exc, words = BAD_PREFILL[case]
    with pytest.raises(exc) as info:
        kda_prefill(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_packed_prefill_pool_checks_one_index_per_sequence() -> None:
    kwargs = prefill()
    packed_inputs = {name: kwargs[name][:1] for name in ("q", "k", "v", "g", "beta")}
    cu = _i32([0, 5, 5, 20])
    with pytest.raises(ValueError, match=r"state_indices must have shape \[N\]=\[3\]"):
        kda_prefill(**packed_inputs, cu_seqlens=cu, state=kwargs["state"], state_indices=_i32([0, 1]))
    from cula_runtime.kda_args import validate_kda_prefill

    args = validate_kda_prefill(**packed_inputs, cu_seqlens=cu, state=kwargs["state"], state_indices=_i32([0, 1, 2]))
    assert args.pool_slots.start == (0, 1, 2) and args.state is kwargs["state"]


def test_a_host_cu_seqlens_rewritten_through_numpy_is_read_again() -> None:
    """A CPU ``cu_seqlens`` reused with new values written through a NumPy view (its version counter unchanged, as a
    serving engine's host buffers) gives the result of a fresh tensor of those values, and new values that break
    the rules are refused: no answer comes from what an earlier call checked."""
    kwargs = packed()
    cu = kwargs["cu_seqlens"]
    pool = kwargs["state"]

    def run(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = pool.clone()
        return kda_decode(**dict(kwargs, state=state, cu_seqlens=cu_seqlens)), state

    run(cu)  # [0, 1, 1, 4] checked (and kept) once
    cu.numpy()[1:3] = 2  # lengths 2, 0, 2
    reused, fresh = run(cu), run(_i32([0, 2, 2, 4]))
    assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])
    cu.numpy()[1] = 3
    with pytest.raises(ValueError, match="non-decreasing"):
        run(cu)


def test_a_reused_cu_seqlens_cpu_copy_is_read_again() -> None:
    """The pool form of ``kda_prefill`` with ``cu_seqlens_cpu``: the host copy rewritten through NumPy (and
    ``cu_seqlens`` by a torch op) gives the result of fresh tensors."""
    base = prefill(state_indices=_i32([-1, 1, 4]))  # (sequence 0 a padding row: its o rows are zeros)
    inputs = {name: base[name][:1] for name in ("q", "k", "v", "g", "beta")}
    cu = _i32([0, 5, 5, 20])
    cu_cpu = cu.clone()

    def run(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = base["state"].clone()
        o, _ = kda_prefill(**inputs, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state=state,
                           state_indices=base["state_indices"])
        return o, state

    run(cu, cu_cpu)
    cu.copy_(_i32([0, 12, 12, 20]))
    cu_cpu.numpy()[1:3] = 12
    reused, fresh = run(cu, cu_cpu), run(_i32([0, 12, 12, 20]), _i32([0, 12, 12, 20]))
    assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])
