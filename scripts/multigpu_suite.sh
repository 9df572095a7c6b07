#!/bin/bash
# The multi-GPU measurements of the sharded Pairformer, data-parallel / fully sharded / context-parallel training and
# ring attention, as named stages, each under its own time limit so that one hang cannot take the others with it.
#   bash scripts/multigpu_suite.sh env shard-check shard-fwd shard-train ddp      # one call of a few minutes
#   bash scripts/multigpu_suite.sh shard-infer ring cp fsdp-esm2
#   bash scripts/multigpu_suite.sh shard-profile ddp-profile                       # where the 2-GPU time goes
# Rows go to $OUT/*.md (shard.md, train.md) and $OUT/ring.jsonl, what passed, failed or timed out to
# $OUT/stages.txt, and every stage's log into $OUT/logs.tgz at the end (the device returns only a few files).
# Runs on 4 GPUs are left out where fewer are visible. Needs torch, triton, lightning and this repository;
# hydra-core/omegaconf/antlr4 may come as pure-Python packages in .whl/site.
set -o pipefail
# NVLink multicast stays off (a program using it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl/site ]; then export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"; fi
out=${OUT:-multigpu_out}
logs=$(mktemp -d)
mkdir -p "$out"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
limit=${STAGE_LIMIT:-150}   # seconds per command

step() {  # name, command...: run under the limit, log, record the outcome
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  local what=ok; [ $rc -eq 124 ] || [ $rc -eq 137 ] && what=timeout; [ $rc -ne 0 ] && [ $what = ok ] && what="failed rc=$rc"
  printf '%-28s %-14s %4ds\n' "$name" "$what" $((SECONDS - t0)) | tee -a "$out/stages.txt"
  if [ $rc -ne 0 ]; then tail -15 "$logs/$name.log"; fi
  return 0
}
shard() {  # P, name, bench_shard args...
  local p=$1 name=$2; shift 2
  [ "$p" -gt "$gpus" ] && return 0
  step "$name" python3 -m torch.distributed.run --standalone --nproc_per_node="$p" scripts/bench_shard.py \
    --out "$out/shard.md" "$@"
}
train() {  # name, train.py overrides...: the run's [throughput] line goes to train.md
  local name=$1; shift
  step "$name" python3 train.py "paths.log_dir=$logs/runs" "run_name=$name" "$@"
  echo "| $name | $(grep '^\[throughput\]' "$logs/$name.log" | tail -1) | $*" >> "$out/train.md"
}

for stage in "$@"; do
  case $stage in
    env)
      { nvidia-smi; nvidia-smi topo -m; python3 -c "import torch, triton; print(torch.__version__, triton.__version__,
torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count())"; } > "$logs/env.log" 2>&1
      echo "env: $gpus GPUs" | tee -a "$out/stages.txt" ;;
    shard-check)
      shard 2 shard-check-2 --mode check
      shard 4 shard-check-4 --mode check ;;
    shard-fwd)
      for p in 1 2 4; do shard $p "shard-fwd-4096-p$p" --mode block-fwd --residues 4096; done ;;
    shard-profile)  # where the sharded in-place block's time goes (collectives against compute), 1 and 2 GPUs
      for p in 1 2; do shard $p "shard-profile-4096-p$p" --mode block-fwd --residues 4096 --profile 15; done ;;
    shard-train)
      for p in 1 2 4; do shard $p "shard-train-4096-p$p" --mode block-train --residues 4096 --checkpoint; done
      for p in 1 2; do shard $p "shard-train-2048-p$p" --mode block-train --residues 2048 --checkpoint; done ;;
    shard-infer)
      shard 1 shard-infer-12288-p1 --mode stack-infer --residues 12288 --blocks 48 --blocks-run 1
      shard 2 shard-infer-12288-p2 --mode stack-infer --residues 12288 --blocks 48 --blocks-run 4
      shard 4 shard-infer-20000-p4 --mode stack-infer --residues 20000 --blocks 48 --blocks-run 2 ;;
    ddp)
      train ddp-gpu1 experiment=bench_evoformer trainer=gpu
      train ddp-gpu2 experiment=bench_evoformer trainer=ddp trainer.devices=2
      [ "$gpus" -ge 4 ] && train ddp-gpu4 experiment=bench_evoformer trainer=ddp trainer.devices=4 ;;
    ddp-profile)  # where DDP's per-step time over one GPU goes: Lightning's simple profiler, 1 and 2 GPUs
      train ddp-prof-gpu1 experiment=bench_evoformer trainer=gpu trainer.profiler=simple
      train ddp-prof-gpu2 experiment=bench_evoformer trainer=ddp trainer.devices=2 trainer.profiler=simple
      for n in 1 2; do
        { echo "### ddp-prof-gpu$n"; echo '```'; grep -A45 "Profiler Report" "$logs/ddp-prof-gpu$n.log" | tr -s " \t" | head -60
          echo '```'; } >> "$out/ddp_profile.md"
      done ;;
    cp)
      # 16384 tokens: one GPU takes about 3.8 s a step, so 24 steps with 6 of warm-up fit the limit
      cp=(experiment=bench_longctx data.seq_len=16384 model.net.max_len=16384 data.batch_size=1 trainer.max_steps=24
          callbacks.throughput.warmup_steps=6)
      train cp-gpu1 "${cp[@]}" trainer=gpu
      train cp-gpu2 "${cp[@]}" trainer=context_parallel trainer.devices=2 ;;
    fsdp-esm2)
      for n in 1 2 4; do
        [ "$n" -gt "$gpus" ] && continue
        strat=fsdp; [ $n -eq 1 ] && strat=gpu
        train "fsdp-esm2-3B-gpu$n" experiment=esm2_mlm model.size=3B trainer=$strat trainer.devices=$n \
          trainer.max_steps=12 trainer.max_epochs=1 data.batch_size=2 data.max_len=510 \
          callbacks.model_checkpoint=null callbacks.last_checkpoint=null logger=csv test=false \
          trainer.limit_val_batches=0 trainer.num_sanity_val_steps=0 +trainer.enable_checkpointing=false \
          callbacks.throughput.warmup_steps=4
      done ;;
    ring)
      step ring-2 env ATTN_ZOO_NO_TUNE=1 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
        scripts/bench_ring.py --check --lengths 32768 131072 --biases none pair --deadline $((limit - 40)) \
        --variants 1:float32 4:bfloat16 --out "$out/ring.jsonl" ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
tar czf "$out/logs.tgz" -C "$logs" --exclude=runs .
cat "$out/stages.txt"
