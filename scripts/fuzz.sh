#!/usr/bin/env bash
# Run every cargo-fuzz target (fuzz/fuzz_targets/) for SECONDS each (default 60), or
# until FUZZ_RUNS executions (default 10 million), whichever comes first.
#
#   scripts/fuzz.sh [SECONDS]            all targets, one after another
#   TARGETS="safetensors sampler" scripts/fuzz.sh 600
#
# Needs the nightly toolchain (`rustup toolchain install nightly`) and cargo-fuzz
# (installed from crates.io if missing). Each target starts from its committed seeds
# (fuzz/seeds/<target>) and grows a working corpus in fuzz/corpus/<target> (not
# committed). A crash, hang (-timeout) or out-of-memory (-rss_limit_mb) leaves its input
# in fuzz/artifacts/<target>/: copy it to fuzz/regressions/<target>/ so that
# tests/fuzz_regressions.rs replays it in CI, then fix the bug. The per-target summary
# (executions, coverage, corpus) is printed at the end and kept in fuzz/logs/.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECS="${1:-60}"
RUNS="${FUZZ_RUNS:-10000000}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
TARGETS="${TARGETS:-$(cargo +nightly fuzz list)}"
mkdir -p logs
status=0
for t in $TARGETS; do
    mkdir -p "corpus/$t"
    echo "=== $t: up to ${SECS}s or $RUNS runs"
    if ! cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$SECS" -runs="$RUNS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"logs/$t.log" 2>&1; then
        echo "!!! $t found a failure: see fuzz/logs/$t.log and fuzz/artifacts/$t/"
        status=1
    fi
done
echo
echo "| target | executions | exec/s | coverage (edges) | features | corpus (files) | result |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
for t in $TARGETS; do
    log="logs/$t.log"
    runs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
    speed=$(grep -ao 'stat::average_exec_per_sec: *[0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
    cov=$(grep -ao 'cov: [0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
    ft=$(grep -ao 'ft: [0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
    files=$(find "corpus/$t" -type f 2>/dev/null | wc -l || true)
    result=ok
    if grep -aqE 'ERROR: libFuzzer|==ERROR|panicked' "$log"; then result=FAILED; fi
    echo "| $t | ${runs:-?} | ${speed:-?} | ${cov:-?} | ${ft:-?} | $files | $result |"
done
exit $status
