#!/usr/bin/env bash
# The GPU measurements of the issues, as run through the device tool on one H200:
#   bash bench/gpu_session.sh train     # issue 2 + 5: AC modes, eager and compiled (llama3.2-1b)
#   bash bench/gpu_session.sh compiled  # the compiled AC runs not in `train`
#   bash bench/gpu_session.sh plan      # issue 6: planner estimate vs max_memory_allocated
#   bash bench/gpu_session.sh finetune  # issue 8: fine-tuning methods, llama3.2-1b dimensions
# Results go to $OUT (or bench/results/gpu); `.whl/` holds wheels the machine lacks (tyro).
set -u
RES=${OUT:-bench/results/gpu}
mkdir -p "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, tyro, scaletrain; print('torch', torch.__version__, torch.cuda.get_device_name())"

case "${1:-train}" in
  train)
    for ac in none selective full; do
      timeout 240 python3 bench/train_gpu.py --batches 4 --ac "$ac" --no-compile --steps 8 \
        --warmup 2 --json "$RES/train_gpu_${ac}_eager.json"
    done
    timeout 300 python3 bench/train_gpu.py --batches 2,4,8 --ac none --steps 8 --warmup 3 \
      --json "$RES/train_gpu_none_compiled.json"
    ;;
  compiled)
    for ac in selective full; do
      timeout 280 python3 bench/train_gpu.py --batches 4 --ac "$ac" --steps 8 --warmup 3 \
        --json "$RES/train_gpu_${ac}_compiled.json"
    done
    ;;
  plan)
    timeout 500 python3 bench/plan_gpu.py && cp bench/results/plan_gpu.json "$RES/"
    ;;
  finetune)
    timeout 500 python3 bench/finetune_cpu.py --device cuda --models 1b \
      --methods full,freeze,lora-r8,lora-r16 --steps 8 --batch 4 --seq-len 512 \
      --precision bf16 --json "$RES/finetune_gpu.json"
    ;;
esac
