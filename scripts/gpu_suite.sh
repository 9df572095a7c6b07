#!/bin/bash
# The single-GPU measurements as named stages, each under its own time limit so that one hang cannot take the others
# with it. Three calls of under 10 minutes (stage limits in seconds; expected minutes when every stage runs to its
# limit, about 9 a call):
#   bash scripts/gpu_suite.sh env tests inference         # A: GPU tests in 4 shards (450), inference paths (90)
#   bash scripts/gpu_suite.sh compile                     # B: compile_module over six lengths, 3 models x 2 modes (510)
#   bash scripts/gpu_suite.sh env patch esm2-ft zoo       # C: attn_zoo.patch (140), ESM-2 650M fine-tune (180),
#                                                         #    zoo models vs originals (210)
# Other stages: esm-graphs (train.py on packed ESM C rows, eager and with model.cuda_graphs, 300), baseline (the triton backend's host time, crop set, Pairformer step, ~300), determinism (SDPA
# kernels' backward repeated, 90), patch-hf (the Hugging Face case of patch alone, 110), zoo-compiled (ESM C
# also under torch.compile / compile_module, 420), zoo-af3 (OpenFold3's and Protenix's Pairformers vs ours, 180;
# their packages come in .whl/site from scripts/prepare_whl_zoo.sh), ab-host (a host-path change before and after, .whl/before, ~400),
# ab-block (the Pairformer block's eager step before and after, the whole before tree in .whl/before, ~200),
# esm2-profile (ESM-2 650M's compiled and graph-replayed steps, ours and fair-esm's, by kernel time, with the rotary
# GPU tests, ~600), compile-par (every model x mode of compile at once, one process each, tuning off: the question is
# whether Inductor runs through the lengths; step times then share the GPU), esm2-peer (ESM-2 650M training step
# at the fine-tune's batch, 8 x 1024, beside fair-esm's own, 150).
# `compile` is also its six stages one by one: compile-pairformer-default, compile-pairformer-reduce-overhead, ...
# Each stage's markdown is appended to $OUT/results.md as it ends, what passed, failed or timed out to
# $OUT/stages.txt, and the logs and CSV files to $OUT/logs.tgz after every stage (the device returns only a few
# files, and a call cut off by its own limit still returns what $OUT holds). LIMIT_PCT scales every limit (50: half).
# ZOO_SMOKE=1 runs the zoo and zoo-af3 stages with --smoke (any device). Needs torch, triton and this repository; transformers
# for patch and zoo; lightning and hydra-core/omegaconf/antlr4 for esm2-ft, the latter may come as pure-Python
# packages in .whl/site (ignored by git: a device call names it in carry).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # as the multi-GPU suite
if [ -d .whl/site ]; then export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"; fi
out=${OUT:-gpu_suite_out}
work=$(mktemp -d)  # bench folders, the fine-tune's checkpoints (GBs): never under $OUT
logs=$work/logs
mkdir -p "$out" "$logs"
if [ -f .whl/cue.tar.xz ]; then  # cuEquivariance (../shared/anchor-wheels) for the Boltz peer rows of `patch`
  mkdir -p "$work/site" && tar xJf .whl/cue.tar.xz -C "$work/site" && export PYTHONPATH="$work/site:$PYTHONPATH"
fi
out=$(cd "$out" && pwd)
if ! command -v python > /dev/null; then  # gpu_tests.sh and esm2_finetune_gpu.sh call python; an image may have python3 alone
  mkdir -p "$work/bin" && ln -s "$(command -v python3)" "$work/bin/python" && export PATH="$work/bin:$PATH"
fi
pct=${LIMIT_PCT:-100}
fasta=models/data/sample/some_proteins.fasta
compile_lengths=447:21,768,300:13,512,1024,257
declare -A compile_limit=([pairformer]=95 [evoformer]=95 [esm2]=65)

step() {  # name, limit (s), command...: run under the limit, log, record the outcome
  local name=$1 limit=$(( $2 * pct / 100 )); shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  local what=ok; [ $rc -eq 124 ] || [ $rc -eq 137 ] && what=timeout; [ $rc -ne 0 ] && [ $what = ok ] && what="failed rc=$rc"
  printf '%-36s %-14s %4ds (limit %ds)\n' "$name" "$what" $((SECONDS - t0)) "$limit" | tee -a "$out/stages.txt"
  if [ $rc -ne 0 ]; then tail -15 "$logs/$name.log"; fi
  return 0
}
collect() {  # title, file...: append the files that exist to results.md; then refresh logs.tgz
  local title=$1; shift
  { echo; echo "## $title ($(date -u +%H:%M) UTC)"; echo; for f in "$@"; do [ -s "$f" ] && cat "$f"; done; } \
    >> "$out/results.md"
  tar czf "$out/logs.tgz" -C "$work" --exclude=esm2_ft/logs --exclude='*.pt' --exclude='*.npy' --exclude=./site . \
    2>/dev/null
}
compile_stage() {  # model, mode
  step "compile-$1-$2" "${compile_limit[$1]}" python3 scripts/compile_lengths.py --model "$1" --modes "$2" \
    --lengths "$compile_lengths"
  grep '^|' "$logs/compile-$1-$2.log" | grep -v -e '^| model' -e '^|---' >> "$work/compile.md"
  { echo "| model | mode | N | first call (s) | step (ms) |"; echo "|---|---|---|---|---|"
    cat "$work/compile.md"; } > "$work/compile_table.md"
}

for stage in "$@"; do
  case $stage in
    env)
      { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
        python3 -c "import transformers as t; print('transformers', t.__version__, 'ESM C:', hasattr(t, 'EsmcForMaskedLM'))"
        python3 -c "import hydra, lightning; print('hydra', hydra.__version__, 'lightning', lightning.__version__)"
        git log -1 --format='commit %h %cI' 2>/dev/null; } > "$logs/env.log" 2>&1
      grep -E "^(torch|transformers|hydra|commit)" "$logs/env.log" | tee "$work/env.txt" >> "$out/stages.txt"
      collect env "$work/env.txt" ;;
    tests)
      step tests 450 env OUT="$work/gpu_tests" bash scripts/gpu_tests.sh "${GPU_SHARDS:-4}" $((420 * pct / 100)) tests/
      collect "GPU tests (4 shards)" "$logs/tests.log" ;;
    compile)
      for model in pairformer evoformer esm2; do
        for mode in default reduce-overhead; do compile_stage $model $mode; done
      done
      collect "compile_module over lengths $compile_lengths" "$work/compile_table.md" ;;
    compile-*-*)
      rest=${stage#compile-}; model=${rest%%-*}; mode=${rest#*-}
      compile_stage "$model" "$mode"
      collect "compile_module over lengths $compile_lengths" "$work/compile_table.md" ;;
    patch)
      python3 -c "import cuequivariance_ops_torch" > "$logs/cue-import.log" 2>&1 || true
      step patch 170 python3 scripts/bench_patch.py --out "$work/patch" --profile
      collect "attn_zoo.patch vs unpatched" "$work/patch/patch.md" ;;
    inference)
      step inference 120 python3 scripts/bench_inference_auto.py --out "$work/inference" --profile 512 1024
      collect "Inference paths" "$work/inference/inference_auto.md" ;;
    compile-par)
      jobs=(pairformer:default pairformer:dynamic pairformer:reduce-overhead evoformer:default evoformer:dynamic
            evoformer:reduce-overhead esm2:default esm2:dynamic esm2:reduce-overhead transformer:default
            transformer:dynamic transformer:reduce-overhead)
      for j in "${jobs[@]}"; do
        ( export ATTN_ZOO_NO_TUNE=1 TORCHINDUCTOR_COMPILE_THREADS=1; step "compile-${j%%:*}-${j#*:}" 430 \
            python3 scripts/compile_lengths.py --model "${j%%:*}" --modes "${j#*:}" --lengths "$compile_lengths" ) &
      done
      wait
      { echo "| model | mode | N | first call (s) | step (ms) |"; echo "|---|---|---|---|---|"
        for j in "${jobs[@]}"; do grep '^|' "$logs/compile-${j%%:*}-${j#*:}.log" | grep -v -e '^| model' -e '^|---'; done
      } > "$work/compile_table.md"
      collect "compile_module over lengths $compile_lengths (${#jobs[@]} processes at once, tuning off)" \
        "$work/compile_table.md" ;;
    esm2-peer)
      step esm2-peer 150 python3 scripts/bench_esm2.py --out "$work/esm2" --models attn-zoo fair-esm \
        --shapes 8x1024 --search-time 0 --time-limit 120
      collect "ESM-2 650M training step beside fair-esm (8 x 1024)" "$work/esm2/esm2.md" ;;
    esm2-ft)
      step esm2-ft 330 env OUT="$work/esm2_ft" bash scripts/esm2_finetune_gpu.sh random "$fasta" 200
      grep -h '^\[throughput\]' "$logs/esm2-ft.log" | tail -1 > "$work/esm2_ft.txt"
      cat "$work/esm2_ft/timings.txt" >> "$work/esm2_ft.txt" 2>/dev/null
      m=$(find "$work/esm2_ft/logs" -name metrics.csv | head -1)  # the loss curve: the header and every row
      [ -n "$m" ] && { echo; echo '```'; cat "$m"; echo '```'; } >> "$work/esm2_ft.txt"
      grep -h -e 'peak' -e 'summary' "$logs/esm2-ft.log" | tail -5 >> "$work/esm2_ft.txt"
      collect "ESM-2 650M fine-tune (random weights, 200 steps) and embedding" "$work/esm2_ft.txt" ;;
    esm-graphs)  # train.py on packed ESM C rows (12 layers, 640 wide), eager against model.cuda_graphs=true
      for g in false true; do
        step "esm-graphs-$g" 150 python3 train.py experiment=esmc_mlm model.size=null model.net.num_layers=12 \
          model.net.width=640 model.net.heads=10 trainer=gpu data.packing=true data.packing_frame=2 data.batch_size=4 data.max_len=510 \
          data.train_samples=400 data.val_samples=8 trainer.max_steps=60 trainer.max_epochs=50 test=false \
          logger=csv paths.log_dir="$work/esm-graphs-$g" run_name=r model.cuda_graphs=$g
        { echo "### model.cuda_graphs=$g"; grep -h '^\[throughput\]' "$logs/esm-graphs-$g.log" | tail -2
          m=$(find "$work/esm-graphs-$g" -name metrics.csv | head -1)
          [ -n "$m" ] && { echo '```'; head -1 "$m"; tail -3 "$m"; echo '```'; }; } > "$work/esm-graphs-$g.txt"
      done
      collect "ESM C training on packed rows, eager and as CUDA graphs (train.py)" "$work/esm-graphs-false.txt" \
        "$work/esm-graphs-true.txt" ;;
    zoo)
      step zoo 210 python3 scripts/bench_zoo.py --out "$work/zoo" ${ZOO_SMOKE:+--smoke}
      collect "Zoo models vs originals" "$work/zoo/zoo.md" ;;
    zoo-af3)  # without openfold3 / protenix (bash scripts/prepare_whl_zoo.sh, carry .whl) their rows say skipped
      step zoo-af3 180 python3 scripts/bench_zoo.py --cases of3-pairformer protenix-pairformer --out "$work/zoo-af3" \
        ${ZOO_SMOKE:+--smoke}
      collect "OpenFold3 and Protenix Pairformers vs ours" "$work/zoo-af3/zoo.md" ;;
    baseline)  # the triton backend's host time, crop-set kernels, Pairformer step, first-step compiles (threads vs
      # worker processes): taken before and after a change to the backend's host code
      step host 40 python3 scripts/bench_host.py
      step host-stub 30 python3 scripts/bench_host.py --stub
      step crop 130 python3 scripts/bench_attention.py --set crop --backends triton flex --time-limit 100 \
        --out "$work/crop"
      step blocks 100 python3 scripts/bench_blocks.py --cases pair384 --backends triton torch --breakdown pair384 \
        --out "$work/blocks"
      for f in host host-stub; do
        { echo "### $f"; echo '```'; tail -12 "$logs/$f.log"; echo '```'; } > "$work/$f.txt"
      done
      collect "Triton backend baseline" "$work/host.txt" "$work/host-stub.txt" "$work/crop/crop.md" \
        "$work/blocks/blocks.md" ;;
    determinism)
      step determinism 90 python3 scripts/check_sdpa_determinism.py --repeats 20 --out "$work/det"
      collect "SDPA backward reproducibility" "$work/det/sdpa_determinism.md" ;;
    esm2-profile)  # ESM-2 650M 8 x 512: wall and kernel time of ours and fair-esm, compiled and as CUDA graphs, one
      # process (~4 compiles of 70-115 s), then the rotary kernels' GPU tests
      step rotary-tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_rotary.py
      step esm2-profile 470 python3 scripts/profile_esm2.py --models attn-zoo+graphs fair-esm+graphs attn-zoo+compile \
        fair-esm+compile --shape 8x512 --out "$work/esm2-profile"
      collect "ESM-2 step profile" "$work/esm2-profile/profile_esm2.md" ;;
    patch-hf)
      step patch-hf 110 python3 scripts/bench_patch.py --cases hf-esm2 --out "$work/patch-hf"
      collect "attn_zoo.patch on Hugging Face ESM-2" "$work/patch-hf/patch.md" ;;
    zoo-compiled)  # ESM C eager and compiled, ours and Hugging Face's (each compile is a first step of ~1 min)
      step zoo-compiled 420 python3 scripts/bench_zoo.py --cases esmc --compile --out "$work/zoo-compiled"
      collect "ESM C eager and compiled" "$work/zoo-compiled/zoo.md" ;;
    ab-host)  # a host-path change before and after, in alternating processes on one machine: bench_host (stubbed
      # and real kernels) and the crop set's host-bound shapes. The before tree: git archive REV attn_ops scripts |
      # tar -x -C .whl/before (each tree's scripts import their own attn_ops)
      if [ ! -d .whl/before ]; then echo "ab-host: no .whl/before" | tee -a "$out/stages.txt"; continue; fi
      for i in 1 2 3; do
        for side in before after; do
          root=.; [ $side = before ] && root=.whl/before
          step "host-stub-$side-$i" 30 python3 $root/scripts/bench_host.py --stub
          step "host-$side-$i" 40 python3 $root/scripts/bench_host.py
        done
      done
      for side in before after; do
        root=.; [ $side = before ] && root=.whl/before
        step "crop-$side" 90 python3 $root/scripts/bench_attention.py --set crop --backends triton flex \
          --shapes "N=128 " "N=200 " "N=256 " "N=300 D=16" --time-limit 70 --out "$work/crop-$side"
      done
      { echo "| run | host, stubbed kernels | cpu, stubbed | host, real kernels | cpu, real |"; echo "|---|---|---|---|---|"
        for i in 1 2 3; do for side in before after; do
          echo "| $side $i | $(grep -o 'host [0-9.]* us' "$logs/host-stub-$side-$i.log") |" \
               "$(grep -o 'cpu [0-9.]* us' "$logs/host-stub-$side-$i.log") |" \
               "$(grep -o 'host [0-9.]* us' "$logs/host-$side-$i.log") |" \
               "$(grep -o 'cpu [0-9.]* us' "$logs/host-$side-$i.log") |"
        done; done; } > "$work/ab.md"
      collect "Host path before / after" "$work/ab.md" "$work/crop-before/crop.md" "$work/crop-after/crop.md" ;;
    ab-block)  # the Pairformer block's eager training step, before and after (.whl/before holds the whole before
      # tree: attn_ops, models, attn_zoo, configs, scripts), alternating processes
      if [ ! -d .whl/before/models ]; then echo "ab-block: no .whl/before/models" | tee -a "$out/stages.txt"; continue; fi
      for i in 1 2; do
        for side in before after; do
          root=.; [ $side = before ] && root=.whl/before
          step "block-$side-$i" 70 python3 $root/scripts/bench_blocks.py --cases pair384 pair299 --backends triton \
            --out "$work/block-$side-$i"
          { echo "### $side $i"; cat "$work/block-$side-$i/blocks.md" 2>/dev/null; } >> "$work/ab_block.md"
        done
      done
      collect "Pairformer block step before / after" "$work/ab_block.md" ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
cat "$out/stages.txt"
