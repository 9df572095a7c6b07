#!/bin/bash
# Training throughput of experiment=bench_evoformer (4 AF2-size Evoformer blocks, 128 x 256 synthetic MSAs, bf16,
# batch 1 per GPU) on 1 GPU and with DDP on 2 GPUs (trainer=ddp), printed as samples/s for both.
#   bash scripts/multigpu_train_check.sh [extra train.py overrides...]
# Needs 2 CUDA GPUs, torch, lightning, einops, triton; hydra-core, omegaconf and antlr4 may come as pure-Python
# packages in .whl/site (see docs/training.md, "Several GPUs"). Logs and run folders go to $OUT (default
# multigpu_out). ThroughputMonitor prints rank 0's samples/s; under DDP every rank trains on its own batch of the
# same size in the same step (the gradient all-reduce keeps them in step), so the run's rate is that times 2.
set -eo pipefail
if [ -d .whl/site ]; then export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"; fi
out=${OUT:-multigpu_out}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "needs 2 GPUs, found $gpus" >&2; exit 1; fi
common=(experiment=bench_evoformer "paths.log_dir=$out/logs" "$@")

run() {  # name, overrides...: train, keep the log, print its [throughput] line
  local name=$1; shift
  if ! python train.py "${common[@]}" "run_name=$name" "$@" > "$out/$name.log" 2>&1; then
    echo "$name failed: tail of $out/$name.log" >&2; tail -30 "$out/$name.log" >&2; exit 1
  fi
  grep "^\[throughput\]" "$out/$name.log" | tail -1
}

one=$(run gpu1 trainer=gpu)
two=$(run ddp2 trainer=ddp trainer.devices=2)
rate() { sed -E 's/^\[throughput\] ([0-9.]+) samples\/s.*/\1/' <<< "$1"; }
r1=$(rate "$one"); r2=$(rate "$two")
echo "1 GPU          : $one"
echo "DDP, 2 GPUs    : $two  (rank 0)"
python - "$r1" "$r2" <<'PY'
import sys
r1, r2 = float(sys.argv[1]), float(sys.argv[2])
print(f"samples/s      : 1 GPU {r1:.2f} | DDP 2 GPUs {2 * r2:.2f} ({r2:.2f} per GPU) | scaling {2 * r2 / r1:.2f}x of 2")
PY
