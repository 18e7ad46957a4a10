#!/usr/bin/env bash
# What the GPU work still owes, as steps for the lent H200; each step is time-capped and writes under $OUT.
# One device call holds at most 10 minutes, so run a few steps per call, e.g.:
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh tests:recurrence tests:tuned
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh tests:cute
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh tests:cutedsl
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh tests:rest
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh bench-fixed
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh bench-rest
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh stress:sm90 stress:cutedsl
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh sanitizer:sm90 sanitizer:cutedsl
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_session.sh profile intra
# Lightning Attention (issue 28), one device call each (caps: tests 400 s, bench 560 s, sanitizer 4 x 130 s, stress
# 400 s); "..." = source .devcarry/bootstrap.sh && source tools/h200_setup.sh. The bench in two calls, the second
# merging into the first's results (its lightning_h200.json, copied into the working tree first):
#   ... && bash tools/h200_session.sh tests:lightning
#   ... && bash tools/h200_lanes.sh tests:lightning-cute tests:lightning-api   (the same in two lanes, one call)
#   ... && LIGHTNING_ONLY=prefill bash tools/h200_session.sh bench:lightning
#   ... && LIGHTNING_ONLY=decode LIGHTNING_MERGE=benchmarks/results/lightning_h200.json \
#          bash tools/h200_session.sh bench:lightning
#   ... && bash tools/h200_session.sh sanitizer:lightning
#   ... && bash tools/h200_session.sh profile:lightning   (the three kernels' times at a few seg_lens)
#   ... && bash tools/h200_session.sh stress:lightning
# The prefill's direct form (kernel C alone; run on an H100 in the thirtieth session), one device call:
#   ... && bash tools/h200_session.sh tests:lightning-direct && LIGHTNING_SANITIZER_SHAPES="prefill-direct \
#          prefill-direct-h0" bash tools/h200_session.sh sanitizer:lightning
#   ... && bash tools/h200_session.sh ab:lightning-forms
#   ... && LIGHTNING_STRESS_ONLY=direct bash tools/h200_session.sh stress:lightning
# FLA's errors on the Lightning GPU tests' cases (the frozen bounds; capped at FLA_LIGHTNING_TIMEOUT, 300 s, where
# all the cases take ~500 s alone; writes $OUT/lightning_fla_errors.py, to be copied to tests/lightning_fla_errors.py;
# only the cases not recorded there yet):
#   ... && FLA_LIGHTNING_TIMEOUT=500 bash tools/h200_session.sh fla:lightning
# TESTS_TIMEOUT raises the caps of tests:sm90-unbounded (300 s) and tests:lightning (400 s), which side-by-side lanes
# (tools/h200_lanes.sh) can outrun on a lent H100.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
# The knob variants timed beside the defaults (bench_kda_prefill.py --extra), none of them the default: BENCH_EXTRA
# (both bench steps; none by default); bench-rest also times sm90's intra form "tensor" forced (REST_EXTRA; varlen:
# "auto" runs "bands" where many bands idle).
# (the forms retired in issue 25, sm90's persistent intra kernel, its recurrence on mma.sync (V blocks of 32, 64 and
# 128) and in batch order, CULA_BLOCK_V, and the CuTeDSL intra variants, are in the history and in benchmarks/results.)
BENCH_EXTRA=${BENCH_EXTRA:-}
REST_EXTRA=${REST_EXTRA:---extra sm90:CULA_SM90_INTRA_TUNED=tensor}
# Stage times (profile_kda.py) of sm90 at each value of one knob: variable, values, block sizes, output file; each line
# prefixed with variable=value. PROFILE_CONFIGS picks the configs.
profile_sm90_knob() {
  local value
  for value in $2; do
    env "$1=$value" timeout 100 python3 benchmarks/profile_kda.py --backend sm90 --block-v "$3" --reps 10 \
      --configs "${PROFILE_CONFIGS:-fixed B1 T16384,fixed B2 T16384,varlen T16384 10xuniform}" \
      | sed "s/^/$1=$value /" | tee -a "$4"
  done
}
# compute-sanitizer (memcheck, racecheck) on one cula.lightning call per shape of tools/sanitize_lightning.py with
# CULA_BACKEND=cutedsl (LIGHTNING_SANITIZER_SHAPES; default: one small prefill, one decode); logs in
# $OUT/sanitizer_lightning_<tool>_<shape>.log; LIGHTNING_SANITIZER_TIMEOUT caps each run (130 s). API errors are not
# reported (tools/h200_sanitizer.sh says why).
sanitize_lightning() {
  local tool shape log
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    for shape in ${LIGHTNING_SANITIZER_SHAPES:-prefill decode}; do
      log="$OUT/sanitizer_lightning_${tool}_${shape}.log"
      CULA_BACKEND=cutedsl timeout "${LIGHTNING_SANITIZER_TIMEOUT:-130}" compute-sanitizer --tool "$tool" \
        --report-api-errors no --error-exitcode 99 python3 tools/sanitize_lightning.py "$shape" > "$log" 2>&1
      echo "lightning $tool $shape: exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    done
  done
}
# Nsight Compute on the KDA decode step in four forms (see the ncu:decode step), one report file each.
ncu_decode() {
  local row=${NCU_DECODE_ROW:-fp32 kfirst H32 HV32 N128} tag args
  local vrow=${row/kfirst/vfirst}
  for tag in kfirst-1line kfirst-whole vfirst pass; do
    case $tag in
      kfirst-1line) args=(--row "$row" --lines 1) ;;
      kfirst-whole) args=(--row "$row" --lines 4) ;;
      vfirst) args=(--row "$vrow") ;;
      pass) args=(--row "$row" --state-pass) ;;
    esac
    timeout 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section SourceCounters python3 tools/ncu_decode.py "${args[@]}" > "$OUT/ncu_decode_$tag.txt" 2>&1
    echo "ncu decode $tag: exit $? | $(grep -m1 'DRAM Throughput' "$OUT/ncu_decode_$tag.txt")"
  done
}
# The Lightning GPU tests that exist (tests/cute/test_lightning_*_gpu.py, tests/gpu/test_lightning_*gpu.py): a missing
# file named to pytest would stop the whole run, and none named would make h200_tests.sh run every GPU test.
# The Lightning GPU test files: $1 "cute" (the kernels'), "api" (the public calls', tests/gpu) or "all"; the first
# two halves run side by side as lanes (tools/h200_lanes.sh), the whole suite being longer than one step's cap.
lightning_gpu_tests() {
  local f files=() globs=()
  [ "$1" = api ] || globs+=(tests/cute/test_lightning_*_gpu.py)
  [ "$1" = cute ] || globs+=(tests/gpu/test_lightning_*gpu.py)
  for f in "${globs[@]}"; do [ -e "$f" ] && files+=("$f"); done
  if [ ${#files[@]} = 0 ]; then echo "no Lightning GPU test files"; return 1; fi
  echo "Lightning GPU tests ($1): ${files[*]}"
  GPU_LOG_TAG=_lightning_$1 timeout "${TESTS_TIMEOUT:-400}" bash tools/h200_tests.sh -q "${files[@]}"
}
for step in "$@"; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case "$step" in
    tests) timeout 580 bash tools/h200_tests.sh -q ;;
    tests:cute) GPU_LOG_TAG=_cute timeout 580 bash tools/h200_tests.sh -q tests/cute ;;
    tests:cutedsl) GPU_LOG_TAG=_cutedsl timeout 580 bash tools/h200_tests.sh -q -k cutedsl tests/gpu tests/api ;;
    tests:rest) GPU_LOG_TAG=_rest timeout 580 bash tools/h200_tests.sh -q \
                  -k "not cute and not cutedsl and not recurrence_matches_oracle and not intra_tuned" ;;
    tests:cutedsl-varlen) GPU_LOG_TAG=_cutedsl_varlen timeout 300 bash tools/h200_tests.sh -q \
                            -k "cutedsl and varlen" tests/gpu tests/api ;;
    # the recurrence at each V block (64, 128: warpgroup MMAs) against fp64 on the 32 cases
    tests:recurrence) GPU_LOG_TAG=_recurrence timeout 580 bash tools/h200_tests.sh -q -k "recurrence_matches_oracle" \
                        tests/sm90 ;;
    # every sm90 test of the unbounded gate's form (oracle bounds, extreme gates, replays), after a change to it
    tests:sm90-unbounded) GPU_LOG_TAG=_sm90_unbounded timeout "${TESTS_TIMEOUT:-300}" bash tools/h200_tests.sh -q \
                            -k "sm90 and (kimi or extreme or slow or wide or unbounded or softplus or replays)" \
                            tests/gpu tests/sm90 ;;
    tests:tuned) GPU_LOG_TAG=_tuned timeout 580 bash tools/h200_tests.sh -q -k "intra_tuned_matches" tests/sm90 ;;
    fla) timeout ${FLA_TIMEOUT:-200} python3 benchmarks/fla_error_bounds.py "$OUT/kda_fla_errors.py" missing ;;
    fla:lightning) timeout ${FLA_LIGHTNING_TIMEOUT:-300} python3 benchmarks/fla_lightning_error_bounds.py "$OUT/lightning_fla_errors.py" \
                     missing ;;
    bench) timeout 580 python3 benchmarks/bench_kda_prefill.py --out "$OUT/kda_prefill_h200.md" ;;
    bench-fixed) timeout 580 python3 benchmarks/bench_kda_prefill.py --only fixed --out "$OUT/kda_prefill_fixed.md" \
                   $BENCH_EXTRA ;;
    bench-rest) timeout 580 python3 benchmarks/bench_kda_prefill.py --only varlen,GVA,H16 \
                  --out "$OUT/kda_prefill_rest.md" $BENCH_EXTRA $REST_EXTRA ;;
    stress|stress:sm90) timeout 400 python3 benchmarks/stress_kda_determinism.py --backend sm90 --out "$OUT/stress_sm90.md" ;;
    stress:cutedsl) timeout 400 python3 benchmarks/stress_kda_determinism.py --backend cutedsl \
                      --out "$OUT/stress_cutedsl.md" ;;
    # the unbounded gate's forms (issue 25), 10^5 replays per problem
    stress:unbounded) for b in ${STRESS_BACKENDS:-sm90 cutedsl}; do timeout 280 python3 \
                        benchmarks/stress_kda_determinism.py --backend $b --gate unbounded --replays 100000 \
                        --out "$OUT/stress_unbounded_$b.md"; done ;;
    stress:decode) timeout 300 python3 benchmarks/stress_kda_determinism.py --backend cutedsl --op decode \
                     --replays 100000 --out "$OUT/stress_decode.md" ;;
    sanitizer|sanitizer:sm90) CULA_BACKEND=sm90 timeout 500 bash tools/h200_sanitizer.sh ;;
    sanitizer:cutedsl) CULA_BACKEND=cutedsl timeout 500 bash tools/h200_sanitizer.sh ;;
    # the unbounded gate's forms (issue 25) on each backend, and the decode kernel (issue 26: any GPU backend runs
    # the CuTeDSL decode kernel)
    sanitizer:unbounded) for b in ${SANITIZER_BACKENDS:-sm90 cutedsl}; do CULA_BACKEND=$b SANITIZER_SHAPES="small-kimi gva-extreme large-kimi" \
                           timeout 500 bash tools/h200_sanitizer.sh; done ;;
    sanitizer:decode) CULA_BACKEND=cutedsl SANITIZER_SHAPES="${SANITIZER_SHAPES:-decode-kimi decode-gva-vfirst decode-bf16 decode-spec decode-whole-rows}" \
                        timeout 400 bash tools/h200_sanitizer.sh ;;
    # the prefill kernels' clamps of a device cu_seqlens unlike the host tables (37th session): the GPU test, then
    # memcheck on both backends at the two mismatch shapes
    tests:cu-clamps) GPU_LOG_TAG=_cu_clamps timeout 300 bash tools/h200_tests.sh -q tests/gpu/test_kda_prefill_cu_seqlens_gpu.py ;;
    sanitizer:cu-clamps) for b in ${SANITIZER_BACKENDS:-sm90 cutedsl}; do CULA_BACKEND=$b SANITIZER_TOOLS=memcheck \
                           SANITIZER_SHAPES="cu-mismatch cu-mismatch-pool" timeout 280 bash tools/h200_sanitizer.sh; done ;;
    profile) timeout 300 python3 benchmarks/profile_kda.py | tee "$OUT/profile_kda.txt" ;;
    # each BV (64 and 128: warpgroup MMAs)
    profile:sm90) timeout 100 python3 benchmarks/profile_kda.py --backend sm90 | tee -a "$OUT/profile_kda_sm90.txt" ;;
    # the intra kernel's forms, each forced
    profile:tuned) profile_sm90_knob CULA_SM90_INTRA_TUNED "${TUNED_FORMS:-tensor bands}" 64 "$OUT/profile_kda_tuned.txt" ;;
    # the intra kernel without each phase's arithmetic (timing only; needs CULA_SM90_ABLATION=1 when sourcing
    # tools/h200_setup.sh, which builds those forms)
    profile:ablation) profile_sm90_knob CULA_SM90_INTRA_TUNED \
                        "${ABLATION_FORMS:-tensor ablate:gate ablate:norm-exp ablate:products ablate:inverse ablate:solve ablate:loads ablate:stores ablate:io}" 64 \
                        "$OUT/profile_kda_ablation.txt" ;;
    intra) timeout 200 python3 benchmarks/bench_kda_intra.py --out "$OUT/kda_intra_h200.md" ;;
    ncu) timeout 580 bash tools/h200_ncu.sh ;;
    # Nsight Compute on one KDA decode step (tools/ncu_decode.py): K-first at 1 line and whole rows, V-first, and the
    # in-place pass over the same bytes (NCU_DECODE_ROW: the K-first row; ~3 min); $OUT/ncu_decode_<tag>.txt
    ncu:decode) ncu_decode ;;
    # the cutedsl prefill's host time by stage, its kernel launches alone included (the planned call's bound launches
    # against the unplanned call's)
    host:cutedsl) timeout 400 python3 benchmarks/host_overhead_kda.py --backend cutedsl --calls 50 --reps 30 \
                    --out "$OUT/kda_host_overhead_cutedsl_h200.md" ;;
    # the planned cutedsl lightning_prefill call's host time (its T <= 4096 rows are mostly host time)
    host:lightning) timeout 300 python3 benchmarks/host_path_lightning_prefill.py --gpu \
                      | tee "$OUT/lightning_prefill_host_h200.md" ;;
    # end-to-end time minus kernel time: varlen T16384 10xuniform spent ~0.2 ms outside its kernels, fixed ~0.06
    host:gap) timeout 400 python3 benchmarks/host_overhead_kda.py --backend sm90 --calls 50 --reps 30 \
                --configs "${HOST_CONFIGS:-fixed B1 T16384,fixed B2 T16384,varlen T16384 10xuniform}" \
                --out "$OUT/kda_host_gap_h200.md" ;;
    # stage times of the configs still short of issue 3's goal, at both warpgroup-MMA block sizes
    profile:short) timeout 200 python3 benchmarks/profile_kda.py --backend sm90 --block-v 64,128 --reps 10 \
                     --configs "${PROFILE_CONFIGS:-fixed B2 T4096,fixed B2 T8192,varlen T4096 10xuniform,varlen T4096 20xrandom,varlen T8192 10xuniform,varlen T16384 10xuniform}" \
                     | tee "$OUT/profile_kda_short.txt" ;;
    # serving (issue 26): the pool forms of the prefill and the decode, against fp64 and each other
    tests:pool) GPU_LOG_TAG=_pool timeout 400 bash tools/h200_tests.sh -q tests/gpu/test_kda_prefill_pool_gpu.py \
                  tests/sm90/test_kda_sm90_pool_gpu.py ;;
    tests:decode) GPU_LOG_TAG=_decode timeout 300 bash tools/h200_tests.sh -q tests/cute/test_kda_decode_gpu.py \
                    tests/gpu/test_kda_decode_gpu.py ;;
    # the decode against FLA (DECODE_ONLY: bench_kda_decode.py --only), then the pool-form prefill
    bench:decode) timeout 420 python3 benchmarks/bench_kda_decode.py ${DECODE_ONLY:+--only "$DECODE_ONLY"} \
                    --out "$OUT/kda_decode_h200.md" ;;
    bench:pool-prefill) timeout 300 python3 benchmarks/bench_kda_decode.py --pool-prefill \
                          --out "$OUT/kda_pool_prefill_h200.md" ;;
    # the ecosystem doors (issue 27): FLA's chunk_kda / decode through cuLA against FLA's own path, torch.compile of a
    # KDA layer and a captured decode op; each door's host time. FLA's own path autotunes its Triton kernels per shape
    # on a fresh machine (75-80 s per case on a lent H100): the FLA door tests take two calls, half the cases each
    # (the second backend's test of a case reuses the first's tuning); the custom ops ~30 s.
    tests:doors-ops) GPU_LOG_TAG=_doors_ops timeout 300 bash tools/h200_tests.sh -q tests/gpu/test_custom_ops_gpu.py ;;
    tests:doors-fla1) GPU_LOG_TAG=_doors_fla1 timeout 560 bash tools/h200_tests.sh -q \
                        -k "B2-T200-H4 or B2-T129-H4-HV8-vk or B3-T130-H2-noh0 or varlen-0-1-64-65-200" \
                        tests/integrations/test_fla_backend_gpu.py ;;
    tests:doors-fla2) GPU_LOG_TAG=_doors_fla2 timeout 560 bash tools/h200_tests.sh -q \
                        -k "not (B2-T200-H4 or B2-T129-H4-HV8-vk or B3-T130-H2-noh0 or varlen-0-1-64-65-200)" \
                        tests/integrations/test_fla_backend_gpu.py ;;
    bench:doors) timeout 400 python3 benchmarks/host_doors_kda.py --backend all --out "$OUT/kda_host_doors_h200.md" ;;
    # the custom op's host time split into torch's way in/out and the body's steps (~1 min)
    host:op-split) timeout 200 python3 benchmarks/host_op_split_kda.py --out "$OUT/kda_host_op_split.md" ;;
    # an in-place pass over decode pools in the K-first decode's CTA shape and two others (Triton; ~1 min)
    probe:state-access) timeout 200 python3 benchmarks/probe_state_access.py --out "$OUT/decode_state_access_probe.md" ;;
    # the K-first decode CTAs at 1, 2 and 4 lines per K row side by side (KDA and Lightning rows, N >= 128; ~4 min;
    # AB_ONLY, AB_MIN_N, AB_LINES: the script's options)
    ab:k-first-lines) timeout 400 python3 benchmarks/ab_decode_k_first_lines.py ${AB_ONLY:+--only "$AB_ONLY"} ${AB_MIN_N:+--min-n "$AB_MIN_N"} ${AB_LINES:+--lines "$AB_LINES"} --out "$OUT/decode_k_first_lines_ab.md" ;;
    # the unbounded gate's Kimi rows against FLA (UNB_ONLY: bench_kda_unbounded.py --only)
    bench:unbounded) timeout 560 python3 benchmarks/bench_kda_unbounded.py ${UNB_ONLY:+--only "$UNB_ONLY"} \
                       --out "$OUT/kda_unbounded_h200.md" ;;
    # Lightning Attention (issue 28): the GPU tests, the bench against FLA (LIGHTNING_ONLY: bench_lightning.py
    # --only; LIGHTNING_MERGE: an earlier run's JSON to merge into), the sanitizer, 10^5 graph replays per problem
    tests:lightning) lightning_gpu_tests all ;;
    tests:lightning-cute) lightning_gpu_tests cute ;;
    tests:lightning-api) lightning_gpu_tests api ;;
    bench:lightning) timeout 560 python3 benchmarks/bench_lightning.py ${LIGHTNING_ONLY:+--only "$LIGHTNING_ONLY"} \
                       ${LIGHTNING_MERGE:+--merge "$LIGHTNING_MERGE"} --deadline-s 480 --out "$OUT/lightning_h200.md" ;;
    sanitizer:lightning) sanitize_lightning ;;
    # the prefill's kernels timed per seg_len (LIGHTNING_SEG_LENS; 0: the per-call choice)
    profile:lightning) timeout 300 python3 benchmarks/profile_lightning.py --seg-lens "${LIGHTNING_SEG_LENS:-0,256,512,1024}" \
                         --reps 20 --shapes 1,32768,64 1,32768,16 1,16384,64 1,4096,64 2,4096,16 \
                         1,1024,64 | tee "$OUT/profile_lightning.txt" ;;
    stress:lightning) timeout 400 python3 benchmarks/stress_lightning_determinism.py --backend cutedsl \
                        ${LIGHTNING_STRESS_ONLY:+--only "$LIGHTNING_STRESS_ONLY"} --replays 100000 \
                        --out "$OUT/stress_lightning.md" ;;
    # the prefill's direct form (kernel C alone, every sequence one segment): its GPU tests, then both forms timed
    # side by side on the bench's rows and serving-like batches (LIGHTNING_AB_ONLY: the A/B's --only)
    tests:lightning-direct) GPU_LOG_TAG=_lightning_direct timeout "${TESTS_TIMEOUT:-300}" bash tools/h200_tests.sh \
                              -q -k "forms or fills or direct_form" tests/gpu/test_lightning_gpu.py ;;
    ab:lightning-forms) timeout 560 python3 benchmarks/ab_lightning_prefill_forms.py \
                          ${LIGHTNING_AB_ONLY:+--only "$LIGHTNING_AB_ONLY"} --out "$OUT/lightning_prefill_forms_ab.md" ;;
    # the Lightning decode step at several register caps (CTAs per SM), side by side (LIGHTNING_CAPS: --caps)
    ab:lightning-decode-caps) timeout 300 python3 benchmarks/ab_lightning_decode_caps.py \
                                ${LIGHTNING_CAPS:+--caps "$LIGHTNING_CAPS"} --out "$OUT/lightning_decode_caps_ab.md" ;;
    *) echo "unknown step: $step" \
          "(tests[:cute|:cutedsl|:cutedsl-varlen|:rest|:recurrence|:tuned|:sm90-unbounded]" \
          "fla bench bench-fixed bench-rest stress[:sm90|:cutedsl] sanitizer[:sm90|:cutedsl]" \
          "profile[:sm90|:tuned|:short|:ablation] intra ncu ncu:decode host:gap host:cutedsl host:lightning tests:pool tests:decode bench:decode" \
          "bench:pool-prefill bench:unbounded tests:doors-ops tests:doors-fla1 tests:doors-fla2 bench:doors host:op-split probe:state-access ab:k-first-lines sanitizer:unbounded sanitizer:decode" \
          "stress:unbounded stress:decode tests:lightning[-cute|-api] bench:lightning sanitizer:lightning stress:lightning" \
          "profile:lightning tests:lightning-direct ab:lightning-forms ab:lightning-decode-caps" \
          "tests:cu-clamps sanitizer:cu-clamps)" ;;
  esac
  echo "=== $step: exit $?"
done
