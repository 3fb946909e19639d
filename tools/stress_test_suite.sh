#!/usr/bin/env bash
# The test suite under load: `make test` on a fresh clone of this repository's HEAD, with one busy CPU process
# beside it (as on a laptop that is also doing something else), timed. Reports, per run, pass or fail and the
# minutes `make test` took after the install step; exits non-zero if any run failed.
#
#   tools/stress_test_suite.sh              # one run with one busy process beside it
#   tools/stress_test_suite.sh --runs 3     # three fresh clones, one after the other
#   tools/stress_test_suite.sh --quiet      # no busy process: the figure to hold against the 12-minute target
#
# Each clone lives under ${STRESS_DIR:-/tmp/suite-under-load}/run-N, with its log in run-N.log; the clones reuse
# pip's and npm's caches, so the install step costs a minute or two, and it is timed apart from `make test`.
set -euo pipefail

runs=1
hogs=1
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --quiet) hogs=0; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

repo="$(cd "$(dirname "$0")/.." && pwd)"
base="${STRESS_DIR:-/tmp/suite-under-load}"
mkdir -p "$base"
commit="$(git -C "$repo" rev-parse --short HEAD)"
[ -z "$(git -C "$repo" status --porcelain --untracked-files=no)" ] || \
  echo "note: uncommitted changes are not in the clone; it tests commit $commit"

hog_pids=()
stop_hogs() { for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null || true; done; hog_pids=(); }
trap stop_hogs EXIT

failed=0
for n in $(seq 1 "$runs"); do
  dir="$base/run-$n"
  log="$base/run-$n.log"
  rm -rf "$dir"
  git clone --quiet --no-local "$repo" "$dir"
  start=$(date +%s)
  (cd "$dir" && make .venv/.installed book/_vendor/.installed) >"$log" 2>&1 || { echo "run $n: install failed (see $log)"; failed=1; continue; }
  installed=$(date +%s)
  for _ in $(seq 1 "$hogs"); do
    python3 -c "while True: pass" &
    hog_pids+=($!)
  done
  status=0
  (cd "$dir" && MINIOFFLOAD_REQUIRE_BROWSER="${MINIOFFLOAD_REQUIRE_BROWSER:-1}" make test NBVAL_FLAGS=-vv) >>"$log" 2>&1 || status=$?
  stop_hogs
  end=$(date +%s)
  verdict=$([ "$status" = 0 ] && echo PASS || echo FAIL)
  [ "$status" = 0 ] || failed=1
  minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }
  echo "run $n of $runs (commit $commit, $hogs busy process): $verdict, make test $(minutes $((end - installed))) min" \
    "after a $(minutes $((installed - start))) min install (log: $log)"
  [ "$status" = 0 ] || grep -E "^(FAILED|ERROR)|Error [0-9]+$" "$log" | head -20 || true
done
exit "$failed"
