"""benchmarks/bench_lightning.py's pure logic on the CPU: the floors, the rows and their selection, FLA's decays and
each contender's arguments, the rows measured with stand-in contenders (accuracy against fp64), the tables' goal
marks and the merged results files."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lightning as bench  # noqa: E402

from cula_runtime.reference.lightning import lightning_chunked, lightning_naive  # noqa: E402

FLA_WHEEL = ROOT / ".devcarry" / "fla_core-0.6.0-py3-none-any.whl"
# the contract of cula.lightning (issue 28), for when the API is not importable yet
CULA_PREFILL_PARAMS = {"q", "k", "v", "g_gamma", "layer_idx", "num_layers", "scale", "initial_state",
                       "output_final_state", "cu_seqlens", "state_v_first", "state", "state_indices",
                       "has_initial_state"}
CULA_DECODE_PARAMS = {"q", "k", "v", "g_gamma", "layer_idx", "num_layers", "scale", "state", "state_indices",
                      "state_v_first", "cu_seqlens", "out"}


def _fla_source(path: str) -> ast.Module:
    if not FLA_WHEEL.exists():
        pytest.skip(f"{FLA_WHEEL} absent")
    with zipfile.ZipFile(FLA_WHEEL) as wheel:
        return ast.parse(wheel.read(path).decode())


def _fla_params(path: str, function: str) -> set[str]:
    """The named parameters of ``function`` in the FLA 0.6.0 wheel's ``path`` (read, not imported: no Triton here)."""
    node = next(n for n in ast.walk(_fla_source(path)) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}


def test_prefill_floor_is_qkvo_in_bf16_and_the_states_in_fp32() -> None:
    case = bench.PrefillCase(1, 4096, 64)
    tokens_bytes = 4096 * 64 * (128 + 128 + 128 + 128) * 2  # q, k, v read, o written
    states = 64 * 128 * 128 * 4 * 2  # h0 read, ht written
    assert bench.prefill_floor_bytes(case) == tokens_bytes + states == 276_824_064
    assert bench.floor_us(bench.prefill_floor_bytes(case)) == pytest.approx(276_824_064 / 4.3e12 * 1e6)
    assert bench.floor_us(bench.prefill_floor_bytes(case)) == pytest.approx(64.38, abs=0.01)
    packed = bench.PrefillCase(1, 4096, 64, (1000, 3096))
    assert bench.prefill_floor_bytes(packed) == tokens_bytes + 2 * states  # one state pair per sequence
    assert bench.prefill_floor_bytes(bench.PrefillCase(2, 1024, 16)) == 2 * 1024 * 16 * 512 * 2 + 2 * 16 * 128 * 128 * 8


def test_decode_floor_counts_the_states_twice_in_the_pools_dtype() -> None:
    case = bench.DecodeCase("fp32", False, 128)
    state = 128 * 64 * 128 * 128 * 4 * 2
    assert state == 1_073_741_824
    inputs = 128 * 64 * (3 * 128 + 128) * 2 + 128 * 4 + 64 * 4  # q, k, v, o bf16; indices; g_gamma
    assert bench.decode_floor_bytes(case) == state + inputs
    assert bench.floor_us(bench.decode_floor_bytes(case)) == pytest.approx(251.66, abs=0.01)
    assert bench.decode_floor_bytes(bench.DecodeCase("bf16", False, 128)) == state // 2 + inputs
    assert bench.decode_floor_bytes(bench.DecodeCase("fp32", True, 128)) == state + inputs


def test_rows_are_the_issue_grid_with_unique_names() -> None:
    prefill, decode = bench.prefill_cases(), bench.decode_cases()
    assert len(prefill) == 2 * 4 * 2 + 4 and len(decode) == 3 * 5
    names = bench.row_order()
    assert len(names) == len(set(names)) == 35
    fixed = [c for c in prefill if c.lens is None]
    assert {(c.B, c.T, c.H) for c in fixed} == {(B, T, H) for B in (1, 2) for T in (1024, 4096, 16384, 32768)
                                                for H in (64, 16)}
    packed = [c for c in prefill if c.lens is not None]
    assert sorted((c.T, len(c.lens)) for c in packed) == [(4096, 10), (4096, 20), (16384, 10), (16384, 20)]
    assert all(sum(c.lens) == c.T and min(c.lens) > 0 and c.B == 1 and c.H == 64 for c in packed)
    assert packed[0].name == "prefill varlen T4096 10xrandom H64" and fixed[0].name == "prefill B1 T1024 H64"
    assert {c.N for c in decode} == {1, 8, 32, 128, 512} and {c.H for c in decode} == {64}
    assert decode[0].name == "decode fp32 kfirst N1" and decode[0].slots == 3
    assert {(c.pool_dtype, c.v_first) for c in decode} == {("fp32", False), ("fp32", True), ("bf16", False)}


def test_only_selects_rows_by_whole_words() -> None:
    def chosen(only: str) -> list[str]:
        return [c.name for c in bench.selected(only)]

    assert len(chosen("")) == 35 and len(chosen("prefill")) == 20 and len(chosen("decode")) == 15
    assert chosen("N1") == ["decode fp32 kfirst N1", "decode fp32 vfirst N1", "decode bf16 kfirst N1"]  # not N128
    assert len(chosen("decode fp32 kfirst")) == 5 and len(chosen("varlen")) == 4
    assert len(chosen("T16384")) == 4 + 2 and chosen("B2 T32768 H16") == ["prefill B2 T32768 H16"]
    assert len(chosen("prefill H16, decode N512")) == 8 + 3  # comma: either selector
    assert chosen("prefill B1 T1024 H64")[0] == bench.row_order()[0]


def test_the_decays_are_flas_bits() -> None:
    g = bench.fla_g_gamma(64)
    assert g.dtype == torch.float32 and g.shape == (64,) and g[0] == 0 and bool((g <= 0).all())
    assert float(g[63]) == pytest.approx(-(8 / 64) * 63)
    for path in ("fla/ops/lightning_attn/chunk.py", "fla/ops/lightning_attn/fused_recurrent.py"):
        assign = next(n for n in ast.walk(_fla_source(path)) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "g_gamma" for t in n.targets))
        expr = compile(ast.Expression(assign.value), path, "eval")
        for H in (16, 64):
            for layer_idx, L in ((0, 2), (1, 2), (3, 8)):
                theirs = eval(expr, {"torch": torch, "H": H, "layer_idx": layer_idx, "L": L,  # noqa: S307
                                     "q": torch.zeros(1)})
                assert torch.equal(bench.fla_g_gamma(H, layer_idx, L), theirs), (path, H, layer_idx, L)


def test_fla_arguments_name_parameters_of_fla_0_6_0() -> None:
    prefill = bench.fla_prefill_kwargs(bench.make_prefill_inputs(bench.PrefillCase(1, 64, 2, (20, 44)), "cpu"))
    assert set(prefill) <= _fla_params("fla/ops/lightning_attn/chunk.py", "chunk_lightning_attn")
    assert prefill["cu_seqlens"].dtype == torch.int64 and (prefill["layer_idx"], prefill["num_layers"]) == (0, 2)
    decode = bench.fla_decode_kwargs(bench.make_decode_inputs(bench.DecodeCase("fp32", True, 3, 2), "cpu"))
    assert set(decode) <= _fla_params("fla/ops/simple_gla/fused_recurrent.py", "fused_recurrent_simple_gla")
    assert decode["state_v_first"] is True and decode["output_final_state"] is True


def test_cula_arguments_name_parameters_of_the_lightning_api() -> None:
    try:
        from cula import lightning
    except ImportError:
        prefill_params, decode_params = CULA_PREFILL_PARAMS, CULA_DECODE_PARAMS
    else:
        prefill_params = set(inspect.signature(lightning.lightning_prefill).parameters)
        decode_params = set(inspect.signature(lightning.lightning_decode).parameters)
    inp = bench.make_prefill_inputs(bench.PrefillCase(1, 64, 2, (20, 44)), "cpu")
    kw = bench.cula_prefill_kwargs(inp)
    assert set(kw) <= prefill_params and kw["cu_seqlens"].dtype == torch.int32
    assert kw["g_gamma"] is inp.g_gamma and kw["initial_state"] is inp.h0  # FLA's inputs, the same tensors
    assert bench.fla_prefill_kwargs(inp)["q"] is kw["q"]
    dec = bench.make_decode_inputs(bench.DecodeCase("bf16", False, 3, 2), "cpu")
    kw = bench.cula_decode_kwargs(dec)
    assert set(kw) <= decode_params and kw["state"] is dec.pool and kw["out"] is dec.out
    assert kw["state_indices"].dtype == torch.int32


def test_decode_inputs_are_a_step_on_a_random_subset_of_the_pool() -> None:
    inp = bench.make_decode_inputs(bench.DecodeCase("bf16", True, 5, 4), "cpu")
    assert inp.pool.shape == (11, 4, 128, 128) and inp.pool.dtype == torch.bfloat16
    assert torch.equal(inp.pool, inp.pristine) and inp.pool.data_ptr() != inp.pristine.data_ptr()
    assert len(set(inp.idx.tolist())) == 5 and 0 <= min(inp.idx.tolist()) and max(inp.idx.tolist()) < 11
    assert torch.equal(inp.h0, inp.pool[inp.idx.long()]) and inp.h0.dtype == torch.bfloat16  # FLA's dense h0
    assert torch.allclose(inp.k.float().norm(dim=-1), torch.ones(5, 1, 4), atol=1e-2)
    assert inp.out.shape == (5, 1, 4, 128) and inp.g_gamma.tolist() == bench.fla_g_gamma(4).tolist()


def test_oracle_heads_spread_over_the_heads_with_the_ends() -> None:
    assert bench.oracle_heads(64, 8) == [0, 9, 18, 27, 36, 45, 54, 63]
    assert bench.oracle_heads(16, 0) == list(range(16)) == bench.oracle_heads(16, 16)
    assert bench.oracle_heads(16, 1) == [0] and bench.oracle_heads(16, 2) == [0, 15]


# ------------------------------------------------------------------------- rows measured with stand-in contenders

def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "log", lambda message: None)


def _chunked_prefill(q, k, v, g_gamma, *, scale, initial_state, output_final_state, cu_seqlens):
    """A stand-in for cuLA's prefill: the fp32 chunked reference, o in bf16."""
    o, ht = lightning_chunked(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens)
    return o.to(q.dtype), ht


def _fla_like_prefill(q, k, v, layer_idx, num_layers, scale, initial_state, output_final_state, cu_seqlens):
    """A stand-in for FLA's chunk_lightning_attn: its decays from (layer_idx, num_layers), then the fp32 recurrence."""
    g = bench.fla_g_gamma(q.shape[2], layer_idx, num_layers)
    o, ht = lightning_naive(q.float(), k.float(), v.float(), g, scale, initial_state, output_final_state, cu_seqlens)
    return o.to(q.dtype), ht.float()


@pytest.mark.parametrize("case", [bench.PrefillCase(2, 100, 3), bench.PrefillCase(1, 150, 4, (1, 64, 85))],
                         ids=["B2-T100-H3", "varlen-3seqs-H4"])
def test_a_prefill_row_times_both_and_checks_them_against_fp64(monkeypatch: pytest.MonkeyPatch,
                                                               case: bench.PrefillCase) -> None:
    _no_gpu(monkeypatch)
    timed = {}

    def fake_interleaved(fns: dict, reps: int, rounds: int) -> dict:
        timed.update(fns)
        return {"cula": 0.5, "fla": 1.25}

    monkeypatch.setattr(bench, "interleaved_ms", fake_interleaved)
    opts = SimpleNamespace(oracle_heads=2, seed=0, reps=3, rounds=1)
    fns = {"cula": _chunked_prefill, "fla": _fla_like_prefill}
    warmed = []
    row = bench.measure_prefill(case, fns, opts, lambda: warmed.append(1))
    assert set(timed) == {"cula", "fla"} and warmed == [1] and row["notes"] == {}
    assert row["results"]["cula"]["us"] == 500.0 and row["results"]["fla"]["us"] == 1250.0
    assert row["oracle_heads"] == 2 and row["floor_us"] == bench.floor_us(bench.prefill_floor_bytes(case))
    for name in ("cula", "fla"):
        res = row["results"][name]
        assert res["err_o"] < 5e-3 and res["err_state"] < 1e-5 and res["first_s"] >= 0, (name, res)


def test_a_prefill_row_notes_a_contender_that_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    monkeypatch.setattr(bench, "interleaved_ms", lambda fns, reps, rounds: dict.fromkeys(fns, 1.0))

    def refuses(**kwargs):
        raise NotImplementedError("cula.lightning: CULA_BACKEND=cutedsl rejected: K=64")

    opts = SimpleNamespace(oracle_heads=0, seed=0, reps=3, rounds=1)
    row = bench.measure_prefill(bench.PrefillCase(1, 40, 2), {"cula": refuses, "fla": _fla_like_prefill,
                                                              "x": "not importable (test)"}, opts, lambda: None)
    assert row["notes"]["cula"].startswith("NotImplementedError: cula.lightning: CULA_BACKEND=cutedsl rejected")
    assert row["notes"]["x"] == "not importable (test)" and set(row["results"]) == {"fla"}
    text = bench.render({"runs": [], "rows": [row]})
    assert "| prefill B1 T40 H2 |" in text and "| n/a |" in text and "2 of 2" in text


def _pool_decode(q, k, v, g_gamma, *, scale, state, state_indices, state_v_first, out):
    """A stand-in for cuLA's decode: the fp32 reference step, written into ``out`` and the pool's slots."""
    from cula_runtime.reference.lightning import lightning_decode

    slots = state_indices.long()
    o, new = lightning_decode(q[:, 0], k[:, 0], v[:, 0], g_gamma, state[slots].float(), scale, state_v_first)
    out.copy_(o.unsqueeze(1))
    state[slots] = new.to(state.dtype)
    return out


def _dense_decode(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first):
    """A stand-in for FLA's dense decode: the fp32 reference step on h0, a new final state."""
    from cula_runtime.reference.lightning import lightning_decode

    o, new = lightning_decode(q[:, 0], k[:, 0], v[:, 0], g_gamma, initial_state.float(), scale, state_v_first)
    return o.unsqueeze(1), new


@pytest.mark.parametrize("pool", [("fp32", False), ("fp32", True), ("bf16", False)], ids=["fp32-kfirst",
                                                                                          "fp32-vfirst",
                                                                                          "bf16-kfirst"])
def test_a_decode_row_checks_both_against_fp64_and_times_them(monkeypatch: pytest.MonkeyPatch,
                                                              pool: tuple[str, bool]) -> None:
    _no_gpu(monkeypatch)
    seen = {}

    def fake_time_decode(ready: dict, opts, sleep, notes: dict) -> dict:
        seen.update(ready)
        return {name: {"graph_us": 3.0, "eager_us": 20.0} for name in ready}

    monkeypatch.setattr(bench, "time_decode", fake_time_decode)
    case = bench.DecodeCase(*pool, N=3, H=2)
    row = bench.measure_decode(case, {"cula": _pool_decode, "fla": _dense_decode}, SimpleNamespace(seed=0), None,
                               lambda: None)
    assert set(seen) == {"cula", "fla"} and row["notes"] == {}
    cula, fla = row["results"]["cula"], row["results"]["fla"]
    assert cula["others_kept"] is True and cula["graph_us"] == 3.0 and fla["eager_us"] == 20.0
    state_bound = 1e-6 if pool[0] == "fp32" else 4e-3  # (the bf16 pool is written back in bf16)
    assert cula["err_o"] < 4e-3 and cula["err_state"] < state_bound
    assert fla["err_o"] < 4e-3 and fla["err_state"] < 1e-6


def test_decode_accuracy_sees_missing_writes_and_touched_slots() -> None:
    inp = bench.make_decode_inputs(bench.DecodeCase("fp32", False, 3, 2), "cpu")
    ref = bench.decode_reference(inp)
    kwargs = bench.cula_decode_kwargs(inp)
    good = bench.Contender(functools.partial(_pool_decode, **kwargs), lambda _: (inp.out, inp.pool[inp.idx.long()]))
    assert bench.decode_accuracy(good, inp, ref)["others_kept"] is True
    nothing = bench.Contender(lambda: None, good.read)
    acc = bench.decode_accuracy(nothing, inp, ref)
    assert acc["err_o"] == pytest.approx(1.0) and acc["err_state"] > 0.01
    other = next(s for s in range(inp.case.slots) if s not in inp.idx.tolist())

    def scribbles() -> None:
        good.call()
        inp.pool[other] += 1

    assert bench.decode_accuracy(bench.Contender(scribbles, good.read), inp, ref)["others_kept"] is False


# ---------------------------------------------------------------------------------------- tables and results files

def _prefill_row(case: bench.PrefillCase, cula_us: float, fla_us: float, errs: tuple[float, float] = (1e-3, 2e-3),
                 ) -> dict:
    return {"name": case.name, "kind": "prefill", "case": {"B": case.B, "T": case.T, "H": case.H, "lens": case.lens},
            "floor_us": bench.floor_us(bench.prefill_floor_bytes(case)), "oracle_heads": 8, "notes": {},
            "results": {"cula": {"us": cula_us, "err_o": errs[0], "err_state": 1e-6, "first_s": 9.0},
                        "fla": {"us": fla_us, "err_o": errs[1], "err_state": 1e-6, "first_s": 40.0}}}


def _decode_row(case: bench.DecodeCase, cula_us: float, fla_us: float) -> dict:
    errs = {"err_o": 4e-3, "err_state": 1e-7}
    return {"name": case.name, "kind": "decode", "case": {"pool_dtype": case.pool_dtype, "v_first": case.v_first,
                                                          "N": case.N, "H": case.H},
            "floor_us": bench.floor_us(bench.decode_floor_bytes(case)), "notes": {"fla": "warned: test"},
            "results": {"cula": {"graph_us": cula_us, "replay_us": 9.0, "eager_us": 30.0, "others_kept": True,
                                 **errs},
                        "fla": {"graph_us": fla_us, **errs, "err_o": 2e-3}}}


def _fake_rows() -> list[dict]:
    short_t = bench.PrefillCase(1, 1024, 64)  # no speed-up goal below T 4096
    mid = bench.PrefillCase(1, 4096, 64)  # floor 64.38 us
    long = bench.PrefillCase(1, 16384, 64)  # floor 251.66 us: the floor goal applies
    return [_prefill_row(short_t, 100.0, 150.0), _prefill_row(mid, 100.0, 150.0, (3e-3, 2e-3)),
            _prefill_row(long, 600.0, 2000.0),
            _prefill_row(bench.PrefillCase(1, 16384, 64, (8000, 8384)), 400.0, 1000.0),
            _decode_row(bench.DecodeCase("fp32", False, 8), 7.0, 5.0),
            _decode_row(bench.DecodeCase("fp32", False, 128), 300.0, 260.0)]


def test_tables_mark_each_missed_goal() -> None:
    text = bench.render({"runs": [["- GPU / driver: fake"]], "rows": _fake_rows()})
    lines = text.splitlines()

    def line(start: str) -> str:
        return next(x for x in lines if x.startswith(start))

    assert "| 1.50 |" in line("| prefill B1 T1024 H64 |")  # below T 4096: no speed-up goal
    mid = line("| prefill B1 T4096 H64 |")
    assert "| 1.50 (short) |" in mid and "| 1.55 |" in mid  # 100 us / 64.38: no floor goal below T 16384
    assert "| 1.500, 1.000 (worse) |" in mid  # o error 1.5x FLA's
    long = line("| prefill B1 T16384 H64 |")
    assert "| 3.33 |" in long and "| 2.38 (short) |" in long and "| 7.95 (short) |" in long  # cuLA and FLA / floor
    packed = line("| prefill varlen T16384 2xrandom H64 |")
    assert "| 2.50 |" in packed and "| 1.58 |" in packed
    small = line("| decode fp32 kfirst N8 |")
    assert "| 7.00 (short) |" in small and "| 5.00 |" in small  # <= 6 us per step at N <= 8
    big = line("| decode fp32 kfirst N128 | 251.66 |")
    assert "| 1.19 (short) |" in big and "| 1.03 |" in big  # <= 1.15x the floor at N >= 128
    assert "| 2.000, 1.000 (worse) |" in line("| decode fp32 kfirst N8 | 4.000e-03 |")
    assert "- fla: warned: test (2 rows: decode fp32 kfirst N8, decode fp32 kfirst N128)" in text
    assert "First calls (compilation, autotuning included), the slowest per contender: cula 9.0 s" in text
    assert "- GPU / driver: fake" in text and "dense form" in text


def test_results_are_written_beside_their_json_and_merge_by_row(tmp_path: Path) -> None:
    out = tmp_path / "results" / "lightning.md"
    rows = _fake_rows()
    state = bench.fresh_state()
    state["runs"].append(["- command: first (prefill)"])
    for row in rows[:3]:  # as main does: written after every row
        state["rows"] = bench.put_row(state["rows"], row, bench.row_order())
        bench.write_results(str(out), state)
    assert out.read_text() == bench.render(state) and "## Decode" not in out.read_text()
    merged = bench.load_state(str(out.with_suffix(".json")))
    assert merged == state
    merged["runs"].append(["- command: second (decode)"])
    again = {**rows[1], "results": {"fla": {"us": 140.0}}}
    for row in (rows[5], rows[4], again):
        merged["rows"] = bench.put_row(merged["rows"], row, bench.row_order())
    assert [r["name"] for r in merged["rows"]] == ["prefill B1 T1024 H64", "prefill B1 T4096 H64",
                                                   "prefill B1 T16384 H64", "decode fp32 kfirst N8",
                                                   "decode fp32 kfirst N128"]  # in row_order()
    assert merged["rows"][1]["results"] == {"fla": {"us": 140.0}}  # the new measurement replaces the old
    bench.write_results(str(out), merged)
    text = out.read_text()
    assert "Run 1:" in text and "Run 2:" in text and "## Prefill" in text and "## Decode" in text
    assert bench.load_state("") == bench.fresh_state()


def test_the_defaults_write_the_issue_results_file() -> None:
    opts = bench.parse_args([])
    assert opts.out == "benchmarks/results/lightning_h200.md" and opts.backend == "cutedsl"
    assert (opts.merge, opts.only, opts.oracle_heads, opts.deadline_s) == ("", "", 8, 0.0)
    assert "CULA_BACKEND=cutedsl" in bench.settings_line(opts) and "dense form" in bench.settings_line(opts)


# ------------------------------------------------------------------ the determinism stress's problems, on the CPU

@pytest.mark.parametrize("name", ["prefill fixed B2 T1000 H4", "prefill varlen 6 seqs H4", "prefill pool 6 seqs H4",
                                  "prefill direct 40 seqs H4 pool", "prefill direct64 3 seqs H32 pool",
                                  "decode fp32 kfirst N32 H8", "decode bf16 vfirst N8 H8"])
def test_the_stress_problems_are_valid_calls_that_restart_alike(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each problem of stress_lightning_determinism.py, through cula.lightning's dispatch (the reference on the CPU):
    a valid call whose second run gives the first run's bits (the pool forms restore their pool first)."""
    import stress_lightning_determinism as stress

    assert name in stress.PROBLEMS
    monkeypatch.setattr(stress, "DEVICE", "cpu")
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    step = stress.make_step(name)
    first = [t.clone() for t in step() if t is not None]
    again = [t for t in step() if t is not None]
    assert len(first) == 2 and all(torch.isfinite(t.float()).all() for t in first)
    assert all(torch.equal(stress._bits(a), stress._bits(b)) for a, b in zip(first, again, strict=True))
    if name.startswith("decode"):
        o, pool = first
        assert (o[[1, 5]] == 0).all()  # the padding rows' outputs


def test_the_direct_form_s_problems_take_it_on_an_h200() -> None:
    """The sanitizer's and the stress's wide batch (one list) and the forms A/B's serving rows: on 132 SMs the per-call
    rule runs them in the direct form (what those runs are for); the A/B's rows have distinct names and whole
    batches."""
    import ab_lightning_prefill_forms as ab
    import stress_lightning_determinism as stress

    from cula_runtime.cute.lightning import prefill_backend as pb
    from tools import sanitize_lightning

    assert stress.WIDE_BOUNDS is sanitize_lightning.WIDE_BOUNDS
    assert sanitize_lightning.WIDE_BOUNDS[-1] == sum(sanitize_lightning.WIDE_LENS)
    lens = list(sanitize_lightning.WIDE_LENS)
    assert pb.uses_direct_form(lens, pb.choose_seg_len(lens, 4, 132), 4, 132)
    assert pb.choose_direct_block_v(lens, 4, 132) == 128
    assert stress.HALF_V_BOUNDS is sanitize_lightning.HALF_V_BOUNDS  # the half-V batch: V block 64 on 132 SMs
    bounds, H = sanitize_lightning.HALF_V_BOUNDS, sanitize_lightning.HALF_V_HEADS
    lens = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert pb.uses_direct_form(lens, pb.choose_seg_len(lens, H, 132), H, 132)
    assert pb.choose_direct_block_v(lens, H, 132) == 64 and not pb.uses_direct_form(lens, 64, H, 120)
    rows = ab.rows()
    assert len({name for name, _ in rows}) == len(rows)
    serving = [case for name, case in rows if name.endswith("(serving)")]
    assert len(serving) == len(ab.SERVING) and all(sum(case.lens) == case.T for case in serving)
    for case in serving:
        lens = list(case.lens)
        assert pb.uses_direct_form(lens, pb.choose_seg_len(lens, case.H, 132), case.H, 132), case.name


def test_the_a_b_scripts_select_rows_and_head_their_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--only`` keeps the rows naming one of its substrings (all rows without it); a results file's head has the
    table's columns and a separator of as many cells; each row rewrites the file."""
    import ab_lightning_prefill_forms as ab

    monkeypatch.setattr(ab, "environment", lambda: ["- GPU: none"])

    names = [name for name, _ in ab.rows()]
    assert [name for name, _ in ab.selected_rows("")] == names
    assert [name for name, _ in ab.selected_rows(" serving , B2 T4096 H64")] == \
        [name for name in names if "serving" in name or "B2 T4096 H64" in name]
    assert len(ab.selected_rows("serving")) == len(ab.SERVING)
    head = ab.report_head("Title", "legend", ["row", "a us", "b us"], 132)
    assert head[0] == "# Title" and "- 132 SMs" in head and "legend" in head
    assert head[-2:] == ["| row | a us | b us |", "|---|---|---|"]
    out = tmp_path / "ab.md"
    ab.add_row(head, "| x | 1 | 2 |", str(out))
    assert out.read_text().splitlines()[-1] == "| x | 1 | 2 |"


def test_the_decode_caps_a_b_takes_the_bench_s_large_decode_rows_and_the_product_s_caps() -> None:
    """``ab_lightning_decode_caps.py``: the bench's decode rows of N >= 128, ``--only`` as the other A/Bs; each row's
    default cap is the one the product compiles for its single-token form."""
    import ab_lightning_decode_caps as caps

    names = [case.name for case in caps.rows("")]
    assert names == [case.name for case in bench.decode_cases() if case.N >= 128] and names
    assert [case.name for case in caps.rows("bf16 kfirst, N512")] == \
        [name for name in names if "bf16 kfirst" in name or "N512" in name]
    decode = pytest.importorskip("cula_runtime.cute.lightning.decode", exc_type=ImportError)
    for case in caps.rows(""):
        inp = bench.make_decode_inputs(dataclasses.replace(case, N=1, H=2), "cpu")  # (the same dtypes, layout)
        single_token = ("float32" if case.pool_dtype == "fp32" else "bfloat16", case.v_first, True)
        assert caps.default_cap(inp) == decode.MIN_BLOCKS_PER_SM[single_token]


def test_each_cap_s_step_launches_the_single_token_decode_at_that_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cap_step(inp, cap)`` launches the decode's single-token form on the row's tensors (the pool in place, o into
    ``out``) with ``min_blocks_per_sm = cap`` (0: the default), nothing else changed."""
    import ab_lightning_decode_caps as caps

    pytest.importorskip("cula_runtime.cute.lightning.decode", exc_type=ImportError)
    from tests.cute.compile_helpers import record_launches

    launches = record_launches(monkeypatch)
    inp = bench.make_decode_inputs(bench.DecodeCase("bf16", False, 2, H=2), "cpu")
    for cap in (0, 7):
        caps.cap_step(inp, cap)()
    (_, default, args0), (_, capped, args7) = launches
    assert default.single_token and default.min_blocks_per_sm == 0
    assert capped == dataclasses.replace(default, min_blocks_per_sm=7)
    assert args0[4] is inp.pool and args0[7] is inp.out and args0[8] == inp.scale
    assert all(a is b for a, b in zip(args0[:8], args7[:8], strict=True))
