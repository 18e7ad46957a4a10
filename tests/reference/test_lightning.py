"""Lightning Attention reference (KDA_SPEC §5): chunked fp32 and decode against the fp64 recurrence."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cula_runtime.reference.lightning import lightning_chunked, lightning_decode, lightning_naive

TOL = 1e-5


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (max abs difference if ref is exactly zero)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def fla_g_gamma(H: int, layer_idx: int = 0, num_layers: int = 2) -> torch.Tensor:
    """FLA's lightning decay: g_gamma[h] = -(8/H)(1 - layer_idx/num_layers) h, so head 0 has no decay."""
    return -(8.0 / H) * (1.0 - layer_idx / num_layers) * torch.arange(H, dtype=torch.float32)


def mild_g_gamma(H: int) -> torch.Tensor:
    """Slow decays (head 0 none), so that λ^(C-L) is far from 1 and from 0 for a partial tail chunk."""
    return -torch.linspace(0.0, 0.06, H)


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    V: int
    cu: tuple[int, ...] | None = None
    decay: str = "fla"  # fla | mild
    h0: bool = True
    vfirst: bool = False
    scale: float | None = None

    @property
    def id(self) -> str:
        s = f"B{self.B}-T{self.T}-H{self.H}-K{self.K}-V{self.V}"
        if self.cu is not None:
            s += "-cu" + "_".join(map(str, self.cu))
        s += f"-{self.decay}" + ("-h0" if self.h0 else "-noh0") + ("-vk" if self.vfirst else "-kv")
        return s + ("" if self.scale is None else f"-scale{self.scale}")

    @property
    def N(self) -> int:
        return self.B if self.cu is None else len(self.cu) - 1


def make_inputs(case: Case, seed: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    # Scaled so that the state of the undecayed head 0 stays O(1) in relative terms.
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen) / K**0.5
    v = torch.randn(B, T, H, V, generator=gen)
    g_gamma = fla_g_gamma(H) if case.decay == "fla" else mild_g_gamma(H)
    assert g_gamma[0].item() == 0.0
    kw: dict = dict(output_final_state=True, state_v_first=case.vfirst)
    if case.h0:
        shape = (case.N, H, V, K) if case.vfirst else (case.N, H, K, V)
        kw["initial_state"] = torch.randn(*shape, generator=gen)
    if case.cu is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu, dtype=torch.int32)
    if case.scale is not None:
        kw["scale"] = case.scale
    return (q, k, v, g_gamma), kw


CASES = [
    Case(2, 100, 4, 32, 32, decay="mild"),  # partial tail chunk (L = 36): the cuLA pitfall
    Case(2, 100, 4, 32, 32, decay="mild", vfirst=True),
    Case(1, 100, 2, 64, 16, decay="fla", h0=False),
    Case(1, 1, 2, 16, 16),
    Case(2, 64, 2, 32, 48, vfirst=True),
    Case(1, 200, 4, 64, 64, decay="mild", scale=1.0),
    Case(1, 300, 2, 128, 128, decay="mild"),
    Case(1, 228, 4, 32, 32, cu=(0, 100, 100, 228), decay="mild"),
    Case(1, 70, 2, 32, 16, cu=(0, 0, 70), decay="fla", vfirst=True),
    Case(1, 200, 2, 16, 32, cu=(0, 1, 64, 65, 200), decay="mild", h0=False, vfirst=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chunked_matches_naive(case: Case) -> None:
    args, kw = make_inputs(case, seed=CASES.index(case))
    h0 = kw.get("initial_state")
    h0_copy = None if h0 is None else h0.clone()
    o_ref, ht_ref = lightning_naive(*args, **kw)
    o, ht = lightning_chunked(*args, **kw)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    assert o.shape == (case.B, case.T, case.H, case.V)
    assert rel_l2(o, o_ref) < TOL, rel_l2(o, o_ref)
    assert rel_l2(ht, ht_ref) < TOL, rel_l2(ht, ht_ref)
    if h0 is not None:
        assert torch.equal(h0, h0_copy)


def test_partial_tail_uses_true_length() -> None:
    """T = 100: the final state decays by λ^L with L = 36, not λ^64 (KDA_SPEC §9 item 1)."""
    case = Case(1, 100, 4, 32, 32, decay="mild")
    (q, k, v, g_gamma), kw = make_inputs(case, seed=50)
    _, ht_ref = lightning_naive(q, k, v, g_gamma, **kw)
    _, ht = lightning_chunked(q, k, v, g_gamma, **kw)
    assert rel_l2(ht, ht_ref) < TOL
    # cuLA's tail convention would give λ^(C-L) · ht: for the decaying heads that is clearly different
    wrong = ht_ref * torch.exp(g_gamma.double() * (64 - 36)).view(1, -1, 1, 1)
    for h in range(1, case.H):
        assert rel_l2(wrong[:, h], ht_ref[:, h]) > 0.05
        assert rel_l2(ht[:, h], ht_ref[:, h]) < TOL


def test_head0_no_decay_is_plain_linear_attention() -> None:
    """g_gamma = 0: o_t = scale q_t · (h0 + Σ_{s<=t} k_s v_sᵀ)."""
    case = Case(1, 90, 2, 16, 8)
    (q, k, v, g_gamma), kw = make_inputs(case, seed=51)
    o, ht = lightning_chunked(q, k, v, g_gamma, **kw)
    kv = torch.cumsum(k[0, :, 0].double().unsqueeze(-1) * v[0, :, 0].double().unsqueeze(-2), dim=0)  # [T, K, V]
    S = kw["initial_state"][0, 0].double() + kv
    o_ref = 16**-0.5 * torch.einsum("tk,tkv->tv", q[0, :, 0].double(), S)
    assert rel_l2(o[0, :, 0], o_ref) < TOL
    assert rel_l2(ht[0, 0], S[-1]) < TOL


def test_zero_length_sequence_keeps_initial_state() -> None:
    case = Case(1, 70, 2, 16, 16, cu=(0, 0, 70, 70))
    (q, k, v, g_gamma), kw = make_inputs(case, seed=52)
    h0 = kw["initial_state"]
    for fn in (lightning_naive, lightning_chunked):
        _, ht = fn(q, k, v, g_gamma, **kw)
        assert torch.equal(ht[0].double(), h0[0].double())
        assert torch.equal(ht[2].double(), h0[2].double())
        assert not torch.allclose(ht[1].double(), h0[1].double())


def test_bf16_output_dtype() -> None:
    case = Case(1, 100, 2, 32, 32, decay="mild")
    (q, k, v, g_gamma), kw = make_inputs(case, seed=53)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    o_ref, ht_ref = lightning_naive(q, k, v, g_gamma, **kw)
    o, ht = lightning_chunked(q, k, v, g_gamma, **kw)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert rel_l2(ht, ht_ref) < TOL
    assert rel_l2(o, o_ref) < 5e-3


@pytest.mark.parametrize("vfirst", [False, True], ids=["kv", "vk"])
def test_decode_is_one_naive_step(vfirst: bool) -> None:
    gen = torch.Generator().manual_seed(60)
    N, H, K, V = 3, 4, 32, 16
    q = torch.randn(N, H, K, generator=gen)
    k = torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, H, V, generator=gen)
    g_gamma = fla_g_gamma(H)
    state = torch.randn(*((N, H, V, K) if vfirst else (N, H, K, V)), generator=gen)
    state_copy = state.clone()
    o, new_state = lightning_decode(q, k, v, g_gamma, state, scale=0.7, state_v_first=vfirst)
    assert torch.equal(state, state_copy)  # the input state is not modified
    assert new_state.dtype == torch.float32 and new_state.shape == state.shape
    o_ref, ht_ref = lightning_naive(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g_gamma, scale=0.7, initial_state=state,
        output_final_state=True, state_v_first=vfirst,
    )  # fmt: skip
    assert rel_l2(o, o_ref[:, 0]) < 1e-6
    assert rel_l2(new_state, ht_ref) < 1e-6
    o_bf16, _ = lightning_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), g_gamma, state, state_v_first=vfirst)
    assert o_bf16.dtype == torch.bfloat16


def test_prefill_then_decode_matches_recurrence() -> None:
    case = Case(2, 77, 2, 32, 32, decay="mild", vfirst=True)
    (q, k, v, g_gamma), kw = make_inputs(case, seed=61)
    o_ref, ht_ref = lightning_naive(q, k, v, g_gamma, **kw)
    _, ht = lightning_chunked(q[:, :-1], k[:, :-1], v[:, :-1], g_gamma, **kw)
    o_last, ht_last = lightning_decode(q[:, -1], k[:, -1], v[:, -1], g_gamma, ht, state_v_first=True)
    assert rel_l2(o_last, o_ref[:, -1]) < TOL
    assert rel_l2(ht_last, ht_ref) < TOL


def test_argument_errors() -> None:
    (q, k, v, g_gamma), _ = make_inputs(Case(2, 10, 2, 8, 8, h0=False), seed=62)
    with pytest.raises(ValueError):
        lightning_chunked(q, k, v, g_gamma, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError):
        lightning_naive(q, k, v, g_gamma[:1])
    with pytest.raises(ValueError):
        lightning_decode(q[:, 0], k[:, 0], v[:, 0], g_gamma, torch.zeros(2, 2, 8, 4))
