#!/bin/bash
# Fine-tune ESM-2 650M from a fair-esm .pt on one GPU for 200 steps, then embed a FASTA file with the checkpoint:
#   bash scripts/esm2_finetune_gpu.sh esm2_t33_650M_UR50D.pt proteins.fasta [steps]
#   bash scripts/esm2_finetune_gpu.sh random proteins.fasta      # no weights at hand: a fair-esm-layout file of
#                                                                # random weights (same shapes, same code path)
# train.py needs hydra-core and omegaconf: on a machine without them, carry their wheels and install them first
#   (here: pip download hydra-core omegaconf antlr4-python3-runtime==4.9.3 -d wheels/; there: pip install wheels/*).
# Writes to ${OUT:-esm2_finetune_out}: the run folder (logs/train/runs/esm2_650m_ft), emb/ and timings.txt.
set -euo pipefail
weights=${1:?fair-esm .pt (or 'random')}; fasta=${2:?FASTA file}; steps=${3:-200}
out=${OUT:-esm2_finetune_out}; mkdir -p "$out"
python -c "import hydra, omegaconf" 2>/dev/null || {
  echo "hydra-core is not installed: train.py needs it (carry its wheels, see the header of $0)" >&2; exit 1; }
if [ "$weights" = random ]; then
  weights="$out/esm2_t33_650M_random.pt"
  python - "$weights" <<'EOF'
import sys, torch
from attn_zoo.models import esm2, zoo
torch.manual_seed(0)
torch.save(zoo.to_fair_esm(esm2.esm2("650M"), layout="checkpoint"), sys.argv[1])
EOF
fi
start=$(date +%s)
python train.py experiment=esm2_mlm trainer=gpu model.size=650M "model.pretrained=$weights" \
  model.attention.backend=triton model.optimizer.lr=2e-5 model.scheduler.total_iters=20 \
  "data.fasta=$fasta" data.max_len=1022 data.batch_size=8 data.train_samples=$((steps * 8)) \
  trainer.max_steps="$steps" trainer.max_epochs=1 "paths.log_dir=$out/logs" run_name=esm2_650m_ft \
  callbacks.last_checkpoint.every_n_train_steps=100  # each save of 650M with AdamW state is about 8 GB
mid=$(date +%s)
ckpt="$out/logs/train/runs/esm2_650m_ft/checkpoints/last.ckpt"
python scripts/embed.py --model "$ckpt" --fasta "$fasta" --out "$out/emb" --include mean per_tok \
  --device cuda --dtype bf16 --attention triton --overwrite --no-progress
end=$(date +%s)
echo "train ${steps} steps: $((mid - start)) s; embed: $((end - mid)) s" | tee "$out/timings.txt"
