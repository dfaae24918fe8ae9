#!/usr/bin/env bash
# A Slurm array job: one partition of the sweep per array task, one GPU each.
#   sbatch scripts/sweep/slurm.sh prompts.jsonl /path/to/model
# then, when the array is done:
#   kvdiff sweep summarize --json summary.json sweep-*.jsonl
#SBATCH --job-name=kvdiff-sweep
#SBATCH --array=1-16
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --output=sweep-%a.log
set -euo pipefail
prompts=$1 model=$2
n=${SLURM_ARRAY_TASK_COUNT:-16}
k=$SLURM_ARRAY_TASK_ID
# --partition k/n takes every n-th case from the k-th: the n tasks cover every case once.
# A requeued task resumes: cases already in sweep-k.jsonl are skipped.
kvdiff sweep --model "$model" --backend cuda --chunkings random:4 --seed 1 \
  --partition "$k/$n" --out "sweep-$k.jsonl" "$prompts" || [ $? -eq 1 ]   # 1: divergences found
