#!/usr/bin/env bash
# The GPU measurements of the issues, as run through the device tool on one H200:
#   bash bench/gpu_session.sh train     # issue 2 + 5: AC modes, eager and compiled (llama3.2-1b)
#   bash bench/gpu_session.sh compiled  # the compiled AC runs not in `train`
#   bash bench/gpu_session.sh plan      # issue 6: planner estimate vs max_memory_allocated
#   bash bench/gpu_session.sh finetune  # issue 8: fine-tuning methods, llama3.2-1b dimensions
#   bash bench/gpu_session.sh largest   # issue 2: larger compiled micro-batches
#   bash bench/gpu_session.sh profile   # issue 7: profile + diagnose debug / llama3.2-1b,
#                                       # eager / compiled; the debug model's tokens/s by batch
#   bash bench/gpu_session.sh mfu       # issue 22: bf16 MFU, llama3.2-1b seq 2048, compiled,
#                                       # peak memory with and without the fused loss
#   bash bench/gpu_session.sh fp8       # issue 22: FP8 (tensorwise, rowwise) vs bf16 at 8B-class
#                                       # layer dims (dim 4096, ffn 14336) trimmed to 4 blocks
#   bash bench/gpu_session.sh lora      # issue 22: LoRA r=16 vs full fine-tuning, llama3.2-1b
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
    for ac in none partial full; do
      timeout 240 python3 bench/train_gpu.py --batches 4 --ac "$ac" --no-compile --steps 8 \
        --warmup 2 --json "$RES/train_gpu_${ac}_eager.json"
    done
    timeout 300 python3 bench/train_gpu.py --batches 2,4,8 --ac none --steps 8 --warmup 3 \
      --json "$RES/train_gpu_none_compiled.json"
    ;;
  compiled)
    for ac in partial full; do
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
    timeout 120 python3 bench/lora_layer.py --device cuda --tokens 16384 \
      --out "$RES/lora_layer_gpu.txt"
    ;;
  largest)
    timeout 400 python3 bench/train_gpu.py --batches 16,32 --ac none --steps 6 --warmup 3 \
      --json "$RES/train_gpu_none_compiled_large.json"
    ;;
  profile)
    for model in debug llama3.2-1b; do
      for comp in false true; do
        out=/tmp/prof-$model-$comp
        timeout 200 python3 -m scaletrain profile --config "$model" --output "$out" \
          --training.device cuda --compile.enabled "$comp" --metrics.progress_bar false \
          --data.max_bytes 2000000 --data.vocab_size 8192 \
          > "$RES/profile-$model-compile_$comp.txt" 2>&1
        tail -25 "$RES/profile-$model-compile_$comp.txt"
        cp "$out/profile/diagnosis.json" "$RES/diagnosis-$model-compile_$comp.json" 2>/dev/null
      done
    done
    for comp in "--no-compile" ""; do
      timeout 200 python3 bench/train_gpu.py --model debug --seq-len 256 --batches 8,64 \
        --ac none --steps 10 --warmup 3 $comp --json "$RES/train_gpu_debug${comp:+_eager}.json"
    done
    ;;
  mfu)
    timeout 280 python3 bench/train_gpu.py --batches 8,16,32 --ac none --steps 8 --warmup 3 \
      --json "$RES/train_gpu_mfu_bf16.json"
    timeout 280 python3 bench/train_gpu.py --batches 8,16,32 --ac none --steps 8 --warmup 3 \
      --fused-loss --json "$RES/train_gpu_mfu_bf16_fused_loss.json"
    ;;
  fp8)
    for fp8 in none tensorwise rowwise; do
      timeout 180 python3 bench/train_gpu.py --model llama3.1-8b --layers 4 --batches 2,4 \
        --ac none --steps 8 --warmup 3 --fused-loss --fp8 "$fp8" \
        --json "$RES/train_gpu_8b4l_fp8_${fp8}.json"
    done
    ;;
  lora)
    timeout 500 python3 bench/finetune_cpu.py --device cuda --models 1b \
      --methods full,lora-r16 --steps 8 --batch 4 --seq-len 2048 \
      --precision bf16 --json "$RES/finetune_gpu_seq2048.json"
    timeout 90 python3 bench/lora_layer.py --device cuda --tokens 16384 \
      --out "$RES/lora_layer_gpu.txt"
    ;;
esac
