"""Every bad argument of ``lightning_prefill`` / ``lightning_decode`` raises a ``TypeError``/``ValueError`` naming it
(through the public API, on CPU tensors), and the validators' results hold what the contract says."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from cula.lightning import lightning_decode, lightning_prefill
from cula_runtime.lightning_args import (
    LightningDecodeArgs,
    LightningPrefillArgs,
    layer_g_gamma,
    validate_lightning_decode,
    validate_lightning_prefill,
)

B, T, H, K, V, P = 2, 5, 3, 8, 4, 6


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def prefill_kwargs(**changes) -> dict:
    gen = torch.Generator().manual_seed(0)
    kwargs = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
                  v=torch.randn(B, T, H, V, generator=gen), g_gamma=torch.tensor([0.0, -0.5, -1.0]))
    kwargs.update(changes)
    return {name: value for name, value in kwargs.items() if value is not _DROP}


def packed_kwargs(**changes) -> dict:
    gen = torch.Generator().manual_seed(1)
    kwargs = dict(q=torch.randn(1, 7, H, K, generator=gen), k=torch.randn(1, 7, H, K, generator=gen),
                  v=torch.randn(1, 7, H, V, generator=gen), g_gamma=torch.tensor([0.0, -0.5, -1.0]),
                  cu_seqlens=_i32([0, 3, 3, 7]))
    kwargs.update(changes)
    return {name: value for name, value in kwargs.items() if value is not _DROP}


def pool_kwargs(**changes) -> dict:
    base = dict(state=torch.zeros(P, H, K, V), state_indices=_i32([4, -1]))
    base.update(changes)
    return prefill_kwargs(**base)


def decode_kwargs(**changes) -> dict:
    base = dict(state=torch.zeros(P, H, K, V), state_indices=_i32([4, -1]))
    base.update(changes)
    return prefill_kwargs(**base)


def in_the_pool(kwargs: dict, name: str, of: str = "state") -> dict:
    """``kwargs`` with argument ``name`` a view of the memory of argument ``of`` (the pool by default)."""
    shape = kwargs[name].shape
    return dict(kwargs, **{name: kwargs[of].reshape(-1)[:shape.numel()].view(shape)})


_DROP = object()
X = torch.randn(B, T, H, K)

# (name, kwargs, error type, message pattern): each through lightning_prefill
PREFILL_ERRORS = [
    ("q-not-tensor", prefill_kwargs(q=[1.0]), TypeError, r"q must be a torch\.Tensor, got list"),
    ("q-3d", prefill_kwargs(q=torch.randn(B, T, H)), ValueError, r"q must be 4-D \[B, T, H, K\]"),
    ("k-shape", prefill_kwargs(k=torch.randn(B, T, H, K + 1)), ValueError, r"k must have shape \[2, 5, 3, 8\]"),
    ("v-heads", prefill_kwargs(v=torch.randn(B, T, H + 1, V)), ValueError, r"v must have shape .*no GVA"),
    ("K-zero", prefill_kwargs(q=torch.randn(B, T, H, 0), k=torch.randn(B, T, H, 0)), ValueError,
     r"head dim K \(q\.shape\[-1\]\) must be in \[1, 256\], got 0"),
    ("V-zero", prefill_kwargs(v=torch.randn(B, T, H, 0)), ValueError, r"head dim V \(v\.shape\[-1\]\) must be in"),
    ("K-too-big", prefill_kwargs(q=torch.randn(1, 1, H, 257), k=torch.randn(1, 1, H, 257),
                                 v=torch.randn(1, 1, H, V)), ValueError, r"K \(q\.shape\[-1\]\) must be in \[1, 256\]"),
    ("H-zero", prefill_kwargs(q=torch.randn(B, T, 0, K), k=torch.randn(B, T, 0, K), v=torch.randn(B, T, 0, V),
                              g_gamma=torch.zeros(0)), ValueError, r"head count H .* must be >= 1, got 0"),
    ("q-fp64", prefill_kwargs(q=X.double(), k=X.double(), v=torch.randn(B, T, H, V).double()), TypeError,
     r"q must have dtype in \(torch\.bfloat16, torch\.float16, torch\.float32\), got torch\.float64"),
    ("k-dtype", prefill_kwargs(k=X.bfloat16()), TypeError, r"k must have the dtype of q \(torch\.float32\)"),
    ("v-dtype", prefill_kwargs(v=torch.randn(B, T, H, V).half()), TypeError, r"v must have the dtype of q"),
    ("g-gamma-and-layer", prefill_kwargs(layer_idx=0, num_layers=2), ValueError,
     r"either g_gamma or layer_idx/num_layers .* not both"),
    ("no-decay", prefill_kwargs(g_gamma=None), ValueError, r"the decay is missing: pass g_gamma .* or layer_idx"),
    ("layer-without-num", prefill_kwargs(g_gamma=None, layer_idx=1), ValueError, r"num_layers is missing"),
    ("num-without-layer", prefill_kwargs(g_gamma=None, num_layers=4), ValueError, r"layer_idx is missing"),
    ("layer-negative", prefill_kwargs(g_gamma=None, layer_idx=-1, num_layers=4), ValueError,
     r"layer_idx must be in \[0, num_layers\) = \[0, 4\), got -1"),
    ("layer-too-big", prefill_kwargs(g_gamma=None, layer_idx=4, num_layers=4), ValueError,
     r"layer_idx must be in \[0, num_layers\) = \[0, 4\), got 4"),
    ("num-layers-zero", prefill_kwargs(g_gamma=None, layer_idx=0, num_layers=0), ValueError,
     r"num_layers must be >= 1, got 0"),
    ("layer-float", prefill_kwargs(g_gamma=None, layer_idx=1.0, num_layers=4), TypeError,
     r"layer_idx must be an int, got float"),
    ("layer-bool", prefill_kwargs(g_gamma=None, layer_idx=0, num_layers=True), TypeError,
     r"num_layers must be an int, got bool"),
    ("g-gamma-not-tensor", prefill_kwargs(g_gamma=[0.0, -1.0, -2.0]), TypeError, r"g_gamma must be a torch\.Tensor"),
    ("g-gamma-fp64", prefill_kwargs(g_gamma=torch.zeros(H, dtype=torch.float64)), TypeError,
     r"g_gamma must have dtype torch\.float32, got torch\.float64"),
    ("g-gamma-shape", prefill_kwargs(g_gamma=torch.zeros(H + 1)), ValueError,
     r"g_gamma must have shape \[3\] \(\[H\], one log-decay per head\), got \[4\]"),
    ("g-gamma-positive", prefill_kwargs(g_gamma=torch.tensor([0.0, 0.25, -1.0])), ValueError,
     r"g_gamma must be finite and <= 0 \(a log-decay\), got g_gamma\[1\]=0\.25"),
    ("g-gamma-nan", prefill_kwargs(g_gamma=torch.tensor([0.0, -1.0, float("nan")])), ValueError,
     r"g_gamma must be finite and <= 0 .* g_gamma\[2\]=nan"),
    ("g-gamma-minus-inf", prefill_kwargs(g_gamma=torch.tensor([float("-inf"), -1.0, 0.0])), ValueError,
     r"g_gamma\[0\]=-inf"),
    ("g-gamma-meta-device", prefill_kwargs(g_gamma=torch.zeros(H, device="meta")), ValueError,
     r"g_gamma must be on q's device \(cpu\), got meta"),
    ("scale-zero", prefill_kwargs(scale=0.0), ValueError, r"scale must be a finite positive float"),
    ("scale-str", prefill_kwargs(scale="1"), TypeError, r"scale must be a float or None"),
    ("flag-int", prefill_kwargs(output_final_state=1), TypeError, r"output_final_state must be a bool, got int"),
    ("layout-flag-none", prefill_kwargs(state_v_first=None), TypeError, r"state_v_first must be a bool"),
    ("h0-shape", prefill_kwargs(initial_state=torch.zeros(B, H, V, K)), ValueError,
     r"initial_state must have shape \[2, 3, 8, 4\] \(\[N, H, K, V\], state_v_first=False\)"),
    ("h0-shape-vfirst", prefill_kwargs(initial_state=torch.zeros(B, H, K, V), state_v_first=True), ValueError,
     r"initial_state must have shape \[2, 3, 4, 8\] \(\[N, H, V, K\], state_v_first=True\)"),
    ("h0-bf16", prefill_kwargs(initial_state=torch.zeros(B, H, K, V).bfloat16()), TypeError,
     r"initial_state must have dtype torch\.float32, got torch\.bfloat16"),
    ("h0-not-tensor", prefill_kwargs(initial_state=0.0), TypeError, r"initial_state must be a torch\.Tensor"),
    ("h0-device", prefill_kwargs(initial_state=torch.zeros(B, H, K, V, device="meta")), ValueError,
     r"initial_state must be on q's device"),
    ("cu-float", packed_kwargs(cu_seqlens=torch.tensor([0.0, 3.0, 3.0, 7.0])), TypeError,
     r"cu_seqlens must have dtype torch\.int32 or torch\.int64, got torch\.float32"),
    ("cu-2d", packed_kwargs(cu_seqlens=_i32([[0, 7]])), ValueError, r"cu_seqlens must be 1-D \[N\+1\] with N >= 1"),
    ("cu-one-entry", packed_kwargs(cu_seqlens=_i32([0])), ValueError, r"cu_seqlens must be 1-D \[N\+1\] with N >= 1"),
    ("cu-batch", prefill_kwargs(cu_seqlens=_i32([0, 5])), ValueError, r"B must be 1, got B=2"),
    ("cu-start", packed_kwargs(cu_seqlens=_i32([1, 3, 7])), ValueError, r"cu_seqlens\[0\] must be 0, got 1"),
    ("cu-decreasing", packed_kwargs(cu_seqlens=_i32([0, 4, 3, 7])), ValueError,
     r"cu_seqlens must be non-decreasing, got cu_seqlens\[2\]=3 < cu_seqlens\[1\]=4"),
    ("cu-end", packed_kwargs(cu_seqlens=_i32([0, 3, 6])), ValueError,
     r"cu_seqlens\[-1\] must equal the packed length T=7, got 6"),
    ("cu-device", packed_kwargs(cu_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
     r"cu_seqlens must be on q's device"),
    # the pool form
    ("indices-without-state", prefill_kwargs(state_indices=_i32([0, 1])), ValueError,
     r"state_indices is only used with state .*; pass state too"),
    ("has-without-state", prefill_kwargs(has_initial_state=torch.ones(B, dtype=torch.bool)), ValueError,
     r"has_initial_state is only used with state"),
    ("pool-with-h0", pool_kwargs(initial_state=torch.zeros(B, H, K, V)), ValueError,
     r"initial_state and state are exclusive"),
    ("pool-with-final", pool_kwargs(output_final_state=True), ValueError,
     r"output_final_state=True and state are exclusive"),
    ("pool-no-indices", pool_kwargs(state_indices=None), ValueError, r"state \(the pool\) needs state_indices"),
    ("pool-shape", pool_kwargs(state=torch.zeros(P, H, V, K)), ValueError,
     r"state \(the pool\) must have shape \[P, 3, 8, 4\] \(\[P, H, K, V\], state_v_first=False\), got \[6, 3, 4, 8\]"),
    ("pool-fp64", pool_kwargs(state=torch.zeros(P, H, K, V, dtype=torch.float64)), TypeError,
     r"state must have dtype in \(torch\.float32, torch\.bfloat16\), got torch\.float64"),
    ("pool-fp16", pool_kwargs(state=torch.zeros(P, H, K, V, dtype=torch.float16)), TypeError,
     r"state must have dtype in"),
    ("pool-slots-not-dense", pool_kwargs(state=torch.zeros(P, H, V, K).transpose(-1, -2)), ValueError,
     r"each slot state\[p\] must be dense row-major"),
    ("pool-device", pool_kwargs(state=torch.zeros(P, H, K, V, device="meta")), ValueError,
     r"state must be on q's device"),
    ("indices-int64", pool_kwargs(state_indices=torch.tensor([4, -1])), TypeError,
     r"state_indices must have dtype torch\.int32, got torch\.int64"),
    ("indices-shape", pool_kwargs(state_indices=_i32([4, -1, 0])), ValueError,
     r"state_indices must have shape \[N\]=\[2\] \(one slot per sequence\), got \[3\]"),
    ("indices-2d", pool_kwargs(state_indices=_i32([[4], [1]])), ValueError, r"state_indices must have shape \[N\]"),
    ("indices-past-pool", pool_kwargs(state_indices=_i32([4, 6])), ValueError,
     r"state_indices\[1\]=6 is outside the pool of 6 slots"),
    ("indices-duplicate", pool_kwargs(state_indices=_i32([2, 2])), ValueError,
     r"state_indices: slot 2 is used by sequences 0 and 1"),
    ("has-dtype", pool_kwargs(has_initial_state=torch.ones(B, dtype=torch.int32)), TypeError,
     r"has_initial_state must have dtype torch\.bool, got torch\.int32"),
    ("has-shape", pool_kwargs(has_initial_state=torch.ones(B + 1, dtype=torch.bool)), ValueError,
     r"has_initial_state must have shape \[2\] \(\[N\], one flag per sequence\), got \[3\]"),
    ("pool-slot-stride-0", pool_kwargs(state=torch.zeros(1, H, K, V).expand(P, H, K, V)), ValueError,
     r"its slots must not overlap"),
    ("pool-requires-grad", pool_kwargs(state=torch.zeros(P, H, K, V, requires_grad=True)), ValueError,
     r"state \(the pool\) is written in place and must not require grad"),
    ("v-in-the-pool", in_the_pool(pool_kwargs(), "v"), ValueError, r"^state and v share memory"),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [c[1:] for c in PREFILL_ERRORS],
                         ids=[c[0] for c in PREFILL_ERRORS])
def test_prefill_errors_name_the_argument(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        lightning_prefill(**kwargs)


DECODE_ERRORS = [
    ("q-not-tensor", decode_kwargs(q=None), TypeError, r"q must be a torch\.Tensor, got NoneType"),
    ("v-heads", decode_kwargs(v=torch.randn(B, T, H + 1, V)), ValueError, r"v must have shape"),
    ("K-zero", decode_kwargs(q=torch.randn(B, T, H, 0), k=torch.randn(B, T, H, 0), state=torch.zeros(P, H, 0, V)),
     ValueError, r"head dim K \(q\.shape\[-1\]\) must be in \[1, 256\], got 0"),
    ("V-zero", decode_kwargs(v=torch.randn(B, T, H, 0)), ValueError, r"head dim V"),
    ("both-decays", decode_kwargs(layer_idx=0, num_layers=1), ValueError, r"not both"),
    ("no-decay", decode_kwargs(g_gamma=None), ValueError, r"the decay is missing"),
    ("layer-out-of-range", decode_kwargs(g_gamma=None, layer_idx=3, num_layers=3), ValueError,
     r"layer_idx must be in \[0, num_layers\) = \[0, 3\), got 3"),
    ("g-gamma-positive", decode_kwargs(g_gamma=torch.tensor([0.0, -1.0, 1e-3])), ValueError,
     r"g_gamma must be finite and <= 0"),
    ("g-gamma-bf16", decode_kwargs(g_gamma=torch.zeros(H).bfloat16()), TypeError, r"g_gamma must have dtype"),
    ("state-none", decode_kwargs(state=None), ValueError, r"state \(the pool \[P, H, K, V\] decode reads"),
    ("state-shape", decode_kwargs(state=torch.zeros(P, H, K, V + 1)), ValueError,
     r"state \(the pool\) must have shape \[P, 3, 8, 4\]"),
    ("state-shape-vfirst", decode_kwargs(state_v_first=True), ValueError,
     r"state \(the pool\) must have shape \[P, 3, 4, 8\] \(\[P, H, V, K\], state_v_first=True\)"),
    ("state-fp64", decode_kwargs(state=torch.zeros(P, H, K, V, dtype=torch.float64)), TypeError,
     r"state must have dtype in \(torch\.float32, torch\.bfloat16\)"),
    ("state-not-tensor", decode_kwargs(state=[0.0]), TypeError, r"state must be a torch\.Tensor"),
    ("indices-none", decode_kwargs(state_indices=None), ValueError, r"needs state_indices"),
    ("indices-int64", decode_kwargs(state_indices=torch.tensor([4, -1])), TypeError,
     r"state_indices must have dtype torch\.int32"),
    ("indices-shape", decode_kwargs(state_indices=_i32([4])), ValueError,
     r"state_indices must have shape \[N\]=\[2\]"),
    ("indices-per-token", decode_kwargs(state_indices=_i32([[4, 1], [2, 3]])), ValueError,
     r"state_indices must have shape \[N\]=\[2\] \(one slot per sequence\)"),
    ("indices-past-pool", decode_kwargs(state_indices=_i32([9, 0])), ValueError,
     r"state_indices\[0\]=9 is outside the pool of 6 slots"),
    ("indices-duplicate", decode_kwargs(state_indices=_i32([3, 3])), ValueError, r"slot 3 is used by sequences 0 and"),
    ("cu-dtype", decode_kwargs(q=X[:1], k=X[:1], v=torch.randn(1, T, H, V), state_indices=_i32([0]),
                               cu_seqlens=torch.tensor([0, 5], dtype=torch.int16)), TypeError,
     r"cu_seqlens must have dtype torch\.int32 or torch\.int64, got torch\.int16"),
    ("cu-batch", decode_kwargs(cu_seqlens=_i32([0, 2, 5])), ValueError, r"B must be 1, got B=2"),
    ("cu-end", decode_kwargs(q=X[:1], k=X[:1], v=torch.randn(1, T, H, V), cu_seqlens=_i32([0, 2, 4])), ValueError,
     r"cu_seqlens\[-1\] must equal the packed length T=5, got 4"),
    ("cu-indices-count", decode_kwargs(q=X[:1], k=X[:1], v=torch.randn(1, T, H, V), cu_seqlens=_i32([0, 2, 4, 5])),
     ValueError, r"state_indices must have shape \[N\]=\[3\]"),
    ("out-dtype", decode_kwargs(out=torch.empty(B, T, H, V, dtype=torch.bfloat16)), TypeError,
     r"out must have the dtype of q \(torch\.float32\), got torch\.bfloat16"),
    ("out-shape", decode_kwargs(out=torch.empty(B, T, H, V + 1)), ValueError,
     r"out must have shape \[B, T, H, V\]=\[2, 5, 3, 4\], got \[2, 5, 3, 5\]"),
    ("out-not-contiguous", decode_kwargs(out=torch.empty(B, T, H, 2 * V)[..., ::2]), ValueError,
     r"out must be contiguous"),
    ("out-device", decode_kwargs(out=torch.empty(B, T, H, V, device="meta")), ValueError,
     r"out must be on q's device"),
    ("flag-int", decode_kwargs(state_v_first=0), TypeError, r"state_v_first must be a bool, got int"),
    ("scale-negative", decode_kwargs(scale=-1.0), ValueError, r"scale must be a finite positive float"),
    ("state-slots-overlap", decode_kwargs(state=torch.zeros((P + H) * K * V).as_strided((P, H, K, V),
                                                                                     (K * V, K * V, V, 1))),
     ValueError, r"its slots must not overlap"),
    ("out-is-q", in_the_pool(decode_kwargs(out=torch.empty(B, T, H, V)), "out", "q"), ValueError,
     r"^out and q share memory, and the call writes out in place"),
    ("out-in-the-pool", in_the_pool(decode_kwargs(out=torch.empty(B, T, H, V)), "out"), ValueError,
     r"^state and out share memory"),
    ("out-requires-grad", decode_kwargs(out=torch.empty(B, T, H, V, requires_grad=True)), ValueError,
     r"out is written in place and must not require grad"),
    ("g-gamma-sparse", decode_kwargs(g_gamma=torch.tensor([0.0, -1.0, -2.0]).to_sparse()), TypeError,
     r"g_gamma must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("scale-tiny-fraction", decode_kwargs(scale=Fraction(1, 10**400)), ValueError,
     r"scale must be a finite positive float .* \(as a float: 0\.0\)"),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [c[1:] for c in DECODE_ERRORS],
                         ids=[c[0] for c in DECODE_ERRORS])
def test_decode_errors_name_the_argument(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        lightning_decode(**kwargs)


def test_a_bad_call_leaves_the_pool_untouched() -> None:
    kwargs = decode_kwargs(state=torch.randn(P, H, K, V), state_indices=_i32([1, 1]))
    before = kwargs["state"].clone()
    with pytest.raises(ValueError, match="slot 1 is used by sequences 0 and 1"):
        lightning_decode(**kwargs)
    assert torch.equal(kwargs["state"], before)


def test_prefill_args_hold_the_contract_fields() -> None:
    q = torch.randn(1, 7, H, K).transpose(0, 0)
    k = torch.randn(1, 7, 2 * H, K)[:, :, ::2]  # (not contiguous: copied once)
    args = validate_lightning_prefill(q, k, torch.randn(1, 7, H, V), layer_idx=2, num_layers=4,
                                      cu_seqlens=torch.tensor([0, 3, 3, 7]), state=torch.zeros(P, H, V, K),
                                      state_indices=_i32([5, -1, 0]), state_v_first=True)
    assert isinstance(args, LightningPrefillArgs)
    assert (args.B, args.T, args.H, args.K, args.V, args.N) == (1, 7, H, K, V, 3)
    assert args.k.is_contiguous() and torch.equal(args.k, k)
    assert args.g_gamma is layer_g_gamma(H, 2, 4, "cpu") and args.g_gamma.dtype == torch.float32
    assert args.scale == K ** -0.5 and args.device == torch.device("cpu")
    assert args.cu_seqlens.dtype == torch.int64 and args.has_initial_state is None
    assert args.state_shape == (3, H, V, K) and not args.output_final_state and args.initial_state is None
    fields = {f for f in LightningPrefillArgs.__dataclass_fields__}
    assert fields == {"q", "k", "v", "g_gamma", "scale", "initial_state", "output_final_state", "cu_seqlens",
                      "state_v_first", "state", "state_indices", "has_initial_state", "B", "T", "H", "K", "V", "N"}


def test_decode_args_hold_the_contract_fields() -> None:
    gamma = torch.tensor([0.0, -1.0, -8.0])
    pool = torch.zeros(P, H, K, V, dtype=torch.bfloat16)
    out = torch.empty(1, 4, H, V)
    args = validate_lightning_decode(torch.randn(1, 4, H, K), torch.randn(1, 4, H, K), torch.randn(1, 4, H, V), gamma,
                                     scale=2, state=pool, state_indices=_i32([3, 9 - 10]),
                                     cu_seqlens=_i32([0, 4, 4]), out=out)
    assert isinstance(args, LightningDecodeArgs)
    assert args.g_gamma is gamma and args.state is pool and args.out is out and args.scale == 2.0
    assert (args.B, args.T, args.H, args.K, args.V, args.N, args.P) == (1, 4, H, K, V, 2, P)
    fields = {f for f in LightningDecodeArgs.__dataclass_fields__}
    assert fields == {"q", "k", "v", "g_gamma", "scale", "state", "state_indices", "state_v_first", "cu_seqlens",
                      "out", "B", "T", "H", "K", "V", "N"}


def test_empty_calls_are_valid() -> None:
    """No tokens (B * T == 0) and sequences of no tokens are valid calls; a decode of no tokens writes nothing."""
    o, ht = lightning_prefill(torch.randn(2, 0, H, K), torch.randn(2, 0, H, K), torch.randn(2, 0, H, V),
                              layer_idx=0, num_layers=1, initial_state=torch.ones(2, H, K, V), output_final_state=True)
    assert o.shape == (2, 0, H, V) and torch.equal(ht, torch.ones(2, H, K, V))
    pool = torch.randn(P, H, K, V)
    before = pool.clone()
    o = lightning_decode(torch.randn(1, 0, H, K), torch.randn(1, 0, H, K), torch.randn(1, 0, H, V),
                         torch.zeros(H), state=pool, state_indices=_i32([0, 1]), cu_seqlens=_i32([0, 0, 0]))
    assert o.shape == (1, 0, H, V) and torch.equal(pool, before)


def test_numpy_integers_give_the_layer_decay() -> None:
    np = pytest.importorskip("numpy")
    from cula_runtime.lightning_args import resolve_g_gamma

    got = resolve_g_gamma(None, np.int64(1), np.int32(3), H, torch.device("cpu"))
    assert torch.equal(got, resolve_g_gamma(None, 1, 3, H, torch.device("cpu")))
    with pytest.raises(TypeError, match=r"^layer_idx must be an int, got numpy\.float64$"):
        resolve_g_gamma(None, np.float64(1), 3, H, torch.device("cpu"))
