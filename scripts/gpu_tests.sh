#!/bin/bash
# The GPU tests in parallel shards (their time is mostly Triton compiles, which overlap across processes):
#   bash scripts/gpu_tests.sh 4 300 tests/test_triton_gpu.py tests/test_pairformer.py tests/test_evoformer.py
# args: shards, seconds per shard, test files. Logs go to $OUT (default ./gpu_tests_out), one per shard; prints each
# shard's summary line and any failures. A shard cut off by its time limit prints no summary.
n=$1; t=$2; shift 2
out=${OUT:-gpu_tests_out}; mkdir -p "$out"
ids=$(mktemp); python -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$ids"
echo "$(wc -l < "$ids") GPU tests in $n shards"
prefix=$(mktemp -u)
split -n r/"$n" "$ids" "$prefix."
for f in "$prefix".*; do
  ( timeout "$t" python -m pytest -q -m gpu -p no:cacheprovider $(cat "$f") > "$out/gpu_tests_$(basename "$f").log" 2>&1 ) &
done
wait
for f in "$out"/gpu_tests_*.log; do
  echo "== $f"; grep -E " in [0-9.]+s( |$)" "$f" | tail -1; grep -E "^(FAILED|ERROR)" "$f" | head -20
done
