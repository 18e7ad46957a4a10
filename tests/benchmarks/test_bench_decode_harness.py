"""benchmarks/bench_kda_decode.py's pure logic on the CPU: the floor, the rows and their selection, the arguments
each contender gets, the accuracy check, the unit conversions of the timings, the tables and the results files."""

from __future__ import annotations

import inspect
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kda_decode as bench  # noqa: E402

from cula.kda import kda_decode  # noqa: E402

SMALL = bench.DecodeCase("fp32", False, 2, 4, 3)  # GVA 2, three sequences, a pool of 7 slots


def _inputs(case: bench.DecodeCase = SMALL) -> bench.DecodeInputs:
    return bench.make_decode_inputs(case, device="cpu")


def _on_reference(kwargs: dict) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (none expected on the CPU; the reference is the CPU backend)
        return kda_decode(**kwargs)


def test_floor_counts_the_states_twice_and_every_input_once() -> None:
    case = bench.DecodeCase("fp32", False, 32, 32, 128)
    state = 128 * 32 * 128 * 128 * 4 * 2  # 537 MB: decode.py's docstring figure for N = 128, HV = 32
    assert state == 536_870_912
    inputs = 2 * 128 * 32 * 128 * 2 + 2 * 128 * 32 * 128 * 2 + 128 * 32 * 128 * 4 + 128 * 32 * 4 + 128 * 4
    assert bench.floor_bytes(case, 4) == state + inputs == 543_179_264
    assert bench.floor_us(case, 4) == pytest.approx(543_179_264 / 4.3e12 * 1e6) == pytest.approx(126.32, abs=0.01)
    bf16 = bench.DecodeCase("bf16", False, 32, 32, 128)
    assert bench.floor_bytes(bf16, 4) == state // 2 + inputs
    assert bench.floor_bytes(case, 2) == bench.floor_bytes(case, 4) - 128 * 32 * 128 * 2  # the bf16 raw gate
    gva = bench.DecodeCase("fp32", True, 16, 64, 1)  # q/k are per q/k head: H, not HV
    assert bench.floor_bytes(gva, 4) == 64 * 128 * 128 * 8 + 2 * 16 * 128 * 2 + 2 * 64 * 128 * 2 + 64 * 128 * 4 \
        + 64 * 4 + 4


def test_rows_are_the_issue_matrix_with_unique_names() -> None:
    cases = bench.decode_cases()
    assert len(cases) == len({c.name for c in cases}) == 2 * 2 * 3 * 5
    assert {c.N for c in cases} == {1, 8, 32, 128, 512}
    assert {(c.H, c.HV) for c in cases} == {(32, 32), (8, 8), (16, 64)}
    assert {(c.pool_dtype, c.v_first) for c in cases} == {("fp32", False), ("fp32", True), ("bf16", False),
                                                          ("bf16", True)}
    assert cases[0].name == "fp32 kfirst H32 HV32 N1" and cases[0].slots == 3
    assert bench.DecodeCase("bf16", True, 16, 64, 512).name == "bf16 vfirst H16 HV64 N512"


def test_only_selects_rows_by_whole_words() -> None:
    def chosen(only: str) -> list[str]:
        return [c.name for c in bench.decode_cases() if bench.matches(c.name, only)]

    assert len(chosen("")) == 60
    assert len(chosen("N1")) == 12 and all(name.endswith(" N1") for name in chosen("N1"))  # not N128
    assert len(chosen("fp32 kfirst")) == 15
    assert chosen("HV64 N512") == ["fp32 kfirst H16 HV64 N512", "fp32 vfirst H16 HV64 N512",
                                   "bf16 kfirst H16 HV64 N512", "bf16 vfirst H16 HV64 N512"]
    assert len(chosen("fp32 kfirst, bf16 vfirst N8")) == 15 + 3  # comma: either selector
    assert [cfg.name for cfg in bench.configs() if bench.matches(cfg.name, "fixed B1")] == [
        "fixed B1 T512", "fixed B1 T1024", "fixed B1 T4096", "fixed B1 T8192", "fixed B1 T16384"]


def test_inputs_are_a_kimi_like_step_on_a_random_subset_of_the_pool() -> None:
    inp = _inputs(bench.DecodeCase("bf16", True, 2, 4, 5))
    assert inp.pool.shape == (11, 4, 128, 128) and inp.pool.dtype == torch.bfloat16
    assert torch.equal(inp.pool, inp.pristine) and inp.pool.data_ptr() != inp.pristine.data_ptr()
    assert inp.idx.dtype == torch.int32 and len(set(inp.idx.tolist())) == 5 and 0 <= min(inp.idx.tolist())
    assert max(inp.idx.tolist()) < 11
    assert inp.g.dtype == torch.float32 and bool((inp.g <= 0).all())  # log-decays: decays in (0, 1]
    assert bool(((inp.beta > 0) & (inp.beta < 1)).all())
    assert inp.q.shape == (5, 1, 2, 128) and inp.v.shape == (5, 1, 4, 128) and inp.q.dtype == torch.bfloat16
    assert inp.raw.dtype == torch.bfloat16 and inp.cu_seqlens.tolist() == list(range(6))


@pytest.mark.parametrize("gate", ["fp32", "in-kernel"])
@pytest.mark.parametrize("form", ["dense", "varlen"])
@pytest.mark.parametrize("pool", ["fp32-kfirst", "bf16-vfirst"])
def test_cula_arguments_run_the_step_the_fp64_reference_computes(gate: str, form: str, pool: str) -> None:
    dtype, layout = pool.split("-")
    inp = _inputs(bench.DecodeCase(dtype, layout == "vfirst", 2, 4, 3))
    kwargs = bench.cula_kwargs(inp, gate, form)
    assert set(kwargs) <= set(inspect.signature(kda_decode).parameters)
    assert (kwargs["q"].shape[:2] == (1, 3)) == (form == "varlen") and ("cu_seqlens" in kwargs) == (form == "varlen")
    acc = bench.accuracy(lambda: _on_reference(kwargs), inp, bench.reference_step(inp, gate))
    # the fp32 reference against fp64: o off by its bf16 rounding, the states by fp32's (or bf16's) rounding
    assert acc["err_o"] < 4e-3 and acc["err_state"] < (1e-6 if dtype == "fp32" else 4e-3)
    assert acc["others_kept"] is True
    refusal, served = bench.cula_refusal(kwargs)
    assert served == "reference" and "torch reference" in refusal  # never timed as if it were a kernel


def test_accuracy_sees_missing_writes_and_touched_slots() -> None:
    inp = _inputs()
    ref = bench.reference_step(inp, "fp32")
    nothing = bench.accuracy(lambda: None, inp, ref)
    assert nothing["err_o"] == pytest.approx(1.0) and nothing["err_state"] > 0.05 and nothing["others_kept"]
    other = next(s for s in range(SMALL.slots) if s not in inp.idx.tolist())
    kwargs = bench.cula_kwargs(inp, "fp32")

    def scribbles() -> None:
        _on_reference(kwargs)
        inp.pool[other] += 1

    assert bench.accuracy(scribbles, inp, ref)["others_kept"] is False
    assert bench.accuracy(lambda: _on_reference(kwargs), inp, ref)["others_kept"] is True


def test_fla_gets_its_continuous_batching_path_on_views_of_the_same_tensors() -> None:
    inp = _inputs()
    for gate in ("fp32", "in-kernel"):
        kw = bench.fla_kwargs(inp, gate)
        ours = bench.cula_kwargs(inp, gate)
        for name in ("q", "k", "v", "g", "beta", "out"):
            assert kw[name].shape == (1, 3, *ours[name].shape[2:]), name
            assert kw[name].data_ptr() == ours[name].data_ptr(), name
        assert kw["initial_state"] is inp.pool and kw["ssm_state_indices"] is inp.idx
        assert kw["inplace_final_state"] is True and kw["use_qk_l2norm_in_kernel"] is True
        assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"].tolist() == [0, 1, 2, 3]
        assert kw["state_v_first"] is False and kw.get("use_gate_in_kernel", False) == (gate == "in-kernel")
        if gate == "in-kernel":
            assert kw["A_log"] is inp.A_log and kw["dt_bias"] is inp.dt_bias and kw["g"].dtype == torch.bfloat16


def test_fla_arguments_name_parameters_of_fla() -> None:
    fla = pytest.importorskip("fla.ops.kda.fused_recurrent")
    params = inspect.signature(fla.fused_recurrent_kda_fwd).parameters  # (it also takes **kwargs: names checked)
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    for gate in ("fp32", "in-kernel"):
        assert set(bench.fla_kwargs(_inputs(), gate)) <= named


def test_cutedsl_direct_takes_culas_arguments() -> None:
    decode = pytest.importorskip("cula_runtime.cute.kda.decode")
    params = inspect.signature(decode.kda_decode_cutedsl).parameters
    for form in ("dense", "varlen"):
        assert set(bench.cula_kwargs(_inputs(), "in-kernel", form)) <= set(params)


def test_first_calls_keep_the_reference_out_and_check_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    inp = _inputs()
    runs = {"cula": bench.Decoder(kda_decode, lambda i: bench.cula_kwargs(i, "fp32")),
            "cutedsl-direct": "not importable (test)",
            "fla": bench.Decoder(lambda **kw: _on_reference(bench.cula_kwargs(inp, "fp32")),
                                 lambda i: bench.fla_kwargs(i, "fp32"))}
    row = {"results": {}, "notes": {}, "served": {}}
    ready = bench.first_calls(runs, inp, bench.reference_step(inp, "fp32"), row)
    assert list(ready) == ["fla"]  # cula would run the torch reference here: not timed, said why
    assert "torch reference" in row["notes"]["cula"] and row["served"] == {"cula": "reference"}
    assert row["notes"]["cutedsl-direct"] == "not importable (test)"
    assert set(row["results"]["fla"]) == {"first_s", "err_o", "err_state", "others_kept"}
    assert row["results"]["fla"]["err_state"] < 1e-6


def test_timings_come_out_in_microseconds_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "capture_graph", lambda fn, calls: SimpleNamespace(replay=("graph", calls)))
    seen = {}

    def fake_interleaved(fns: dict, reps: int, rounds: int) -> dict:
        seen.update(fns)
        return {key: {"graph": 0.05, "replay": 0.008, "eager": 0.03}[key.split("|")[1]] for key in fns}

    monkeypatch.setattr(bench, "interleaved_ms", fake_interleaved)
    monkeypatch.setattr(bench, "host_us", lambda fn, calls, sleep, sleep_ms: (12.5, 13.0, True))
    monkeypatch.setattr(bench, "queued_gpu_us", lambda fn, calls, sleep, sleep_ms: (4.25, False))
    opts = SimpleNamespace(graph_calls=10, reps=4, rounds=2, host_calls=8)
    calls = {"cula": lambda: None, "fla": lambda: None}
    out = bench.time_decode(calls, opts, sleep=None, notes={})
    assert seen["cula|graph"] == ("graph", 10) and seen["cula|replay"] == ("graph", 1)
    assert seen["fla|eager"] is calls["fla"]
    assert out["cula"] == {"graph_us": pytest.approx(5.0), "replay_us": pytest.approx(8.0),
                           "eager_us": pytest.approx(30.0), "host_us": 12.5, "host_gpu_busy": True, "gpu_us": 4.25,
                           "host_ahead": False}
    assert bench.time_decode({}, opts, sleep=None, notes={}) == {}  # no contender ran: nothing timed, no error
    seen.clear()
    out = bench.time_decode(calls, opts, sleep=None, notes={}, yardstick=lambda: None)
    assert seen[f"{bench.STATE_PASS}|graph"] == ("graph", 10)  # timed among the contenders' graphs, graph only
    assert out[bench.STATE_PASS] == {"graph_us": pytest.approx(5.0)}


def _row(case: bench.DecodeCase, results: dict, notes: dict | None = None) -> dict:
    return {"name": case.name, "case": asdict(case), "floor_us": bench.floor_us(case, 4), "results": results,
            "notes": notes or {}, "served": {"cula": "cutedsl"}}


def _fake_rows() -> list[dict]:
    small = bench.DecodeCase("fp32", False, 32, 32, 8)
    big = bench.DecodeCase("fp32", False, 32, 32, 128)  # floor 126.32 us
    big16 = bench.DecodeCase("bf16", False, 32, 32, 128)
    errs = {"err_o": 4e-3, "err_state": 1e-7, "others_kept": True}
    return [
        _row(small, {"cula": {"graph_us": 7.0, "replay_us": 11.0, "eager_us": 30.0, "gpu_us": 4.0, "host_us": 25.0,
                              "host_gpu_busy": True, "host_ahead": True, **errs},
                     "fla": {"graph_us": 5.0, "replay_us": 9.0, "eager_us": 90.0, "gpu_us": 5.0, "host_us": 80.0,
                             "host_gpu_busy": True, "host_ahead": False, **errs, "err_o": 2e-3}},
             {"cutedsl-direct": "not importable (no cutlass)"}),
        {**_row(big, {"cula": {"graph_us": 140.0, "host_us": 10.0, "host_gpu_busy": False, **errs},
                      "fla": {"graph_us": 200.0, "host_us": 90.0, **errs}}), "pass_us": 131.37},
        _row(big16, {"cula": {"graph_us": 70.0, **errs}, "fla": {"graph_us": 150.0, **errs}}),
    ]


def test_tables_mark_each_missed_goal() -> None:
    text = bench.render({"runs": [["- GPU / driver: fake"]], "decode": _fake_rows(), "prefill": []})
    graph = [line for line in text.splitlines() if line.startswith("| fp32 kfirst H32 HV32 N8 | ")][0]  # 1st table
    assert "| 7.00 (short) |" in graph and "| 5.00 |" in graph  # <= 6 us per step at N <= 8
    assert "| n/a |" in graph  # cutedsl-direct, with its note below
    big = [line for line in text.splitlines() if line.startswith("| fp32 kfirst H32 HV32 N128 | 126.32 |")][0]
    assert "| 1.11 |" in big and "| 1.58 (short) |" in big  # <= 1.15x the floor at N >= 128
    assert big.startswith("| fp32 kfirst H32 HV32 N128 | 126.32 | 131.37 (1.04x) |")  # the state pass yardstick
    assert graph.startswith("| fp32 kfirst H32 HV32 N8 | 7.90 | - |")  # (a row without it: merged from before)
    eager = [line for line in text.splitlines() if line.startswith("| fp32 kfirst H32 HV32 N8 | 30.0 |")][0]
    assert "| 25.0 (short) |" in eager and "| 80.0 (short) |" in eager and "| 5.00 (host-bound) |" in eager
    assert "| 10.0 (waited) |" in text  # host timing where a call waited for the GPU
    assert "| kfirst H32 HV32 N128 | 0.500 | - | 0.750 (short) |" in text  # bf16 <= 0.6x fp32, N >= 128
    assert "| 2.000, 1.000 (worse) |" in text  # cula's o error twice FLA's on the N8 row
    assert "- cutedsl-direct: not importable (no cutlass) (1 rows: fp32 kfirst H32 HV32 N8)" in text
    assert "- cula: served by the cutedsl backend (3 rows:" in text
    assert "- GPU / driver: fake" in text


def test_results_are_written_beside_their_json_and_merge_by_row(tmp_path: Path) -> None:
    out = tmp_path / "results" / "decode.md"
    rows = _fake_rows()
    order = [c.name for c in bench.decode_cases()]
    state = bench.fresh_state()
    state["runs"].append(["- command: first"])
    for row in rows[:2]:  # as main does: written after every row
        state["decode"] = bench.put_row(state["decode"], row, order)
        bench.write_results(str(out), state)
    assert out.read_text() == bench.render(state) and "fp32 kfirst H32 HV32 N128" in out.read_text()
    merged = bench.load_state(str(out.with_suffix(".json")))
    assert merged == state
    merged["runs"].append(["- command: second"])
    again = {**rows[0], "results": {"fla": {"graph_us": 4.0}}}
    for row in (rows[2], again):
        merged["decode"] = bench.put_row(merged["decode"], row, order)
    assert [r["name"] for r in merged["decode"]] == ["fp32 kfirst H32 HV32 N8", "fp32 kfirst H32 HV32 N128",
                                                     "bf16 kfirst H32 HV32 N128"]  # in decode_cases() order
    assert merged["decode"][0]["results"] == {"fla": {"graph_us": 4.0}}  # the new measurement replaces the old
    text = bench.render(merged)
    assert "Run 1:" in text and "Run 2:" in text and "- command: second" in text
    assert bench.load_state("") == bench.fresh_state()


def test_the_pool_prefill_forms_read_and_write_the_same_slots() -> None:
    h0 = torch.randn(3, 2, 4, 4)
    kwargs = {"q": torch.zeros(1), "initial_state": h0, "output_final_state": True, "safe_gate": True}
    base, pool, idx = bench.pool_prefill_state(kwargs, seed=1)
    assert set(base) == {"q", "safe_gate"} and pool.shape == (7, 2, 4, 4) and idx.dtype == torch.int32
    assert torch.equal(pool[idx.long()], h0)
    seen = {}

    def fake_prefill(**kw):
        seen.update(kw)
        if "state" in kw:
            kw["state"][kw["state_indices"].long()] += 1
            return "o", None
        return "o", kw["initial_state"] + 1

    before = pool.clone()
    assert bench.pool_prefill(fake_prefill, base, pool, idx) == "o" and seen["state"] is pool
    after_pool, pool = pool.clone(), before.clone()
    assert bench.gather_prefill(fake_prefill, base, pool, idx.long()) == "o"
    assert seen["output_final_state"] is True and torch.equal(pool, after_pool)  # the same slots, the same values
    assert bench._same_bits((torch.ones(2), pool), (torch.ones(2), after_pool)) is True
    assert bench._same_bits((torch.ones(2), pool), None) is None


def test_prefill_table_gives_the_ratio_and_the_same_bits() -> None:
    row = {"name": "fixed B1 T512", "results": {"sm90 pool": 0.2, "sm90 gather": 0.25},
           "same_bits": {"sm90": True, "cutedsl": None}, "notes": {"cutedsl pool": "cutedsl: rejected"}}
    text = bench.render({"runs": [], "decode": [], "prefill": [row]})
    assert "| fixed B1 T512 | 0.200 | 0.250 | 1.25 | yes | - | - | - | - |" in text
    assert "- cutedsl pool: cutedsl: rejected (1 rows: fixed B1 T512)" in text


def test_the_defaults_write_the_issue_results_file() -> None:
    opts = bench.parse_args([])
    assert opts.out == "benchmarks/results/kda_decode_h200.md" and not opts.pool_prefill
    assert (opts.gate, opts.cula_form, opts.merge, opts.only) == ("fp32", "dense", "", "")
    assert "gate fp32, cula form dense" in bench.settings_line(opts)
