"""One ``cula.lightning`` call at a named shape, for compute-sanitizer (``tools/h200_session.sh sanitizer:lightning``
runs it under memcheck and racecheck with ``CULA_BACKEND=cutedsl``).

    CULA_BACKEND=cutedsl compute-sanitizer --tool memcheck python3 tools/sanitize_lightning.py prefill|decode|...

Shapes (K = V = 128, bf16 q/k/v, FLA's decays for layer 0 of 2, so head 0 has none):

* ``prefill``: a packed batch of five sequences with an empty one and one-token ones (cu = [0, 1, 64, 65, 65, 200]),
  H = 2, fp32 initial states, the final states out;
* ``prefill-pool``: the same batch on an fp32 K-first pool of 7 slots, slots [3, -1, 0, 7, 5] (two padding rows: -1
  and 7 = P), has_initial_state [T, T, F, T, T];
* ``prefill-large``: B = 2, T = 4096, H = 8, V-first fp32 initial states, the final states out (over segments:
  kernel A skips each sequence's last segment, kernel C's last segments write the final states);
* ``prefill-large-pool``: the same batch on an fp32 K-first pool of 3 slots, slots [2, 0], has_initial_state [T, T];
* ``prefill-direct``: a packed batch the per-call rule sends to the direct form (``WIDE_LENS``: 40 sequences, an
  empty one, one-token ones, tails; x 4 heads = 160 CTAs, a wave on up to 177 SMs, none cut) on a bf16 V-first
  pool of 81 slots with padding rows (-1, 81) and a False has_initial_state;
* ``prefill-direct-h0``: the same batch with fp32 K-first initial states, the final states out;
* ``prefill-direct64``: a packed batch the per-call rule sends to the direct form's half-V CTAs on 132 SMs
  (``HALF_V_BOUNDS``: an empty sequence and two of 500 tokens, 52-token tails; H = 32: 128 CTAs of V block 64), fp32
  K-first initial states, the final states out (the script checks the form it gets);
* ``prefill-direct64-pool``: the same batch on a bf16 V-first pool of 3 slots, slots [-1, 2, 0], has_initial_state
  [T, T, F];
* ``decode``: one step of N = 5 sequences on an fp32 K-first pool of 7 slots, slots [2, -1, 6, 7, 0], H = 4, o into
  a given buffer;
* ``decode-bf16``: the same on a bf16 V-first pool;
* ``decode-whole-rows``: the same at N = 32, H = 64 on a pool of 34 slots (two padding rows: -1 and P): 32 x 64
  heads of 64 KB, 128 MiB of state by the rule's count (padding rows included), so the single-token form's K-first
  CTAs take whole rows (4 line groups behind named barriers).

Each call's outputs are checked finite and the padding rows' outputs zero (decode) after a synchronisation, so a
kernel fault surfaces in this process and the sanitizer's report names the launch.
"""

from __future__ import annotations

import itertools
import sys

import torch

K = V = 128
SHAPES = ("prefill", "prefill-pool", "prefill-large", "prefill-direct", "prefill-direct-h0", "prefill-direct64",
          "prefill-direct64-pool", "prefill-large-pool", "decode", "decode-bf16", "decode-whole-rows")
WIDE_LENS = (0, 1, 63, 64, 65, 200, *(40 + 7 * i for i in range(34)))
WIDE_BOUNDS = (0, *itertools.accumulate(WIDE_LENS))  # its cu_seqlens (also the determinism stress's wide batch)
HALF_V_BOUNDS = (0, 0, 500, 1000)  # the half-V batch's cu_seqlens (at H = 32; also the determinism stress's)
HALF_V_HEADS = 32


def _g_gamma(H: int) -> torch.Tensor:
    """FLA's decays for layer 0 of 2 (``bench_lightning.fla_g_gamma``'s formula)."""
    return -(8 / H * (1 - 0 / 2)) * torch.arange(H, dtype=torch.float, device="cuda")


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def run_prefill(shape: str, gen: torch.Generator) -> str:
    from cula.lightning import lightning_prefill

    if shape.startswith("prefill-large"):
        B, T, H, cu = 2, 4096, 8, None
    elif shape.startswith("prefill-direct64"):
        B, T, H, cu = 1, HALF_V_BOUNDS[-1], HALF_V_HEADS, torch.tensor(HALF_V_BOUNDS, dtype=torch.int32,
                                                                       device="cuda")
        _expect_half_v_ctas(T, H, cu)
    elif shape.startswith("prefill-direct"):
        B, T, H, cu = 1, WIDE_BOUNDS[-1], 4, torch.tensor(WIDE_BOUNDS, dtype=torch.int32, device="cuda")
    else:
        B, T, H = 1, 200, 2
        cu = torch.tensor([0, 1, 64, 65, 65, 200], dtype=torch.int32, device="cuda")
    N = B if cu is None else len(cu) - 1
    q, k, v = (_randn(B, T, H, K, gen=gen) for _ in range(3))
    kwargs = {"scale": K ** -0.5, "cu_seqlens": cu}
    if shape in ("prefill-pool", "prefill-direct", "prefill-direct64-pool", "prefill-large-pool"):
        wide = shape == "prefill-direct"
        half_v = shape == "prefill-direct64-pool"
        large = shape == "prefill-large-pool"
        P = 2 * N + 1 if wide else (3 if half_v or large else 7)
        dtype = torch.bfloat16 if wide or half_v else torch.float32
        pool = _randn(P, H, K, V, gen=gen, dtype=dtype)
        before = pool.clone()
        if half_v:
            slots = [-1, 2, 0]
        elif large:
            slots = [2, 0]
        else:
            slots = [2 * n + 1 for n in range(N)] if wide else [3, -1, 0, 7, 5]
            slots[1], slots[3] = -1, P  # padding rows: negative, and one past the pool
        flags = [n != 2 for n in range(N)]
        idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
        has = torch.tensor(flags, device="cuda")
        o, final = lightning_prefill(q, k, v, _g_gamma(H), **kwargs, state=pool, state_indices=idx,
                                     has_initial_state=has, state_v_first=wide or half_v)
        torch.cuda.synchronize()
        untouched = [s for s in range(P) if s not in slots]
        assert final is None and torch.equal(pool[untouched], before[untouched]), "slots no index names changed"
        assert torch.isfinite(pool).all()
    else:
        v_first = shape == "prefill-large"
        h0 = _randn(N, H, V, K, gen=gen, dtype=torch.float32) if v_first else _randn(N, H, K, V, gen=gen,
                                                                                      dtype=torch.float32)
        o, final = lightning_prefill(q, k, v, _g_gamma(H), **kwargs, initial_state=h0, output_final_state=True,
                                     state_v_first=v_first)
        torch.cuda.synchronize()
        assert torch.isfinite(final).all()
    assert torch.isfinite(o).all()
    return f"o {tuple(o.shape)}"


def _expect_half_v_ctas(T: int, H: int, cu: torch.Tensor) -> None:
    """Fail unless the per-call rule sends this batch to the direct form's half-V CTAs on this GPU (132 SMs)."""
    from cula_runtime.cute.lightning import prefill_backend as pb
    from cula_runtime.kda_tuning import sm_count

    device = torch.device("cuda")
    table = pb.device_segments(1, T, H, cu, device, sm_count(device))
    if not (table.direct and table.block_v == pb.HALF_BLOCK_V):
        raise SystemExit(f"{sm_count(device)} SMs: this batch runs {'the direct form' if table.direct else 'segments'}"
                         f" at V block {table.block_v}, not the half-V CTAs the shape is for")


def run_decode(shape: str, gen: torch.Generator) -> str:
    from cula.lightning import lightning_decode

    whole_rows = shape == "decode-whole-rows"
    N, H, P = (32, 64, 34) if whole_rows else (5, 4, 7)
    v_first = shape == "decode-bf16"
    dtype = torch.bfloat16 if v_first else torch.float32
    q, k, v = (_randn(N, 1, H, K, gen=gen) for _ in range(3))
    pool = _randn(P, H, K, V, gen=gen, dtype=dtype)
    before = pool.clone()
    slots = [2, -1, 6, P, 0, *range(8, 8 + N - 5)]
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out = torch.full((N, 1, H, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    o = lightning_decode(q, k, v, _g_gamma(H), scale=K ** -0.5, state=pool, state_indices=idx,
                         state_v_first=v_first, out=out)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr() and torch.isfinite(o).all()
    assert (o[[1, 3]] == 0).all(), "padding rows' outputs not zero"
    untouched = [s for s in range(P) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched]), "slots no index names changed"
    return f"o {tuple(o.shape)}"


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in SHAPES:
        raise SystemExit(f"usage: sanitize_lightning.py {'|'.join(SHAPES)}")
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = argv[0]
    done = run_prefill(shape, gen) if shape.startswith("prefill") else run_decode(shape, gen)
    print(f"{shape}: ok, {done}")


if __name__ == "__main__":
    main(sys.argv[1:])
