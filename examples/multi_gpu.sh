#!/usr/bin/env bash
# Native vs patched GPT-2 training on 2 GPUs: DDP through `accelerate launch`, then FSDP2
# (fully_shard) through torchrun; bf16. Each run prints both loss curves and PASS/FAIL.
#   bash examples/multi_gpu.sh [extra arguments of examples/train_multi_gpu.py]
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${GPUS:-2}
accelerate launch --multi_gpu --num_processes "$GPUS" --num_machines 1 --mixed_precision bf16 \
  --dynamo_backend no examples/train_multi_gpu.py --mode ddp --bf16 "$@"
torchrun --standalone --nproc_per_node "$GPUS" examples/train_multi_gpu.py --mode fsdp2 --bf16 "$@"
