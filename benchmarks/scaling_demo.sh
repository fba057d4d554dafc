#!/usr/bin/env bash
# Issue 14 on the GPU machine: one multirun run twice through the joblib launcher, with one worker and
# with two, from the checkout's root: bash benchmarks/scaling_demo.sh
# Each run's wall time, nvidia-smi samples every second (GPU utilisation, and the processes on each
# GPU), and benchmarks/compare_rows.py between the two runs' rows (every column but timings,
# bit for bit). GPUS1 / GPUS2 are the slot pools ($TILEINFER_GPUS) of the two runs: 0 and 0,1 on a
# two-GPU machine (the default), 0 and 0,0 for two workers sharing one GPU.
# Needs: the device's Python deps in /tmp/tile (pydeps bundle) and hydra-joblib-launcher installed,
# a Qwen tokenizer folder in $QWEN_TOKENIZER. Writes $OUT/scaling.
set -u
export PYTHONPATH=/tmp/tile/site PATH=/tmp/tile/cu13/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset CUDA_HOME CUDA_PATH
R=$OUT/scaling; mkdir -p "$R"
MODEL=${MODEL:-qwen3-0.6b-random}
COMMON="model=$MODEL model.source.random.tokenizer=$QWEN_TOKENIZER backend=triton eval.n_score=256"
GRID="quant=bf16,int8_weights,int8_kv,int8_both ctx=1k,8k"
# Untimed first: Triton's compile cache on disk, so that neither timed run pays the compiles.
python -m tileinfer.sweep $COMMON quant=int8_both ctx=1k runs_dir="$R/warm" > "$R/warm.log" 2>&1 || { tail -5 "$R/warm.log"; exit 1; }
for run in 1:${GPUS1:-0} 2:${GPUS2:-0,1}; do
  n=${run%%:*}; gpus=${run#*:}
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 1 > "$R/gpu-n$n.csv" &
  smi=$!
  ( while sleep 2; do nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader; done ) > "$R/procs-n$n.csv" &
  procs=$!
  t0=$(date +%s.%N)
  TILEINFER_GPUS=$gpus python -m tileinfer.sweep -m hydra/launcher=gpus hydra.launcher.n_jobs=$n $COMMON $GRID \
    runs_dir="$R/n$n" > "$R/n$n.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  kill $smi $procs
  echo "n_jobs=$n TILEINFER_GPUS=$gpus exit=$rc wall_s=$(python -c "print(round($t1 - $t0, 1))")" | tee -a "$R/wall.txt"
done
python -m benchmarks.compare_rows "$R/n1" "$R/n2" > "$R/compare.txt" 2>&1; echo "compare exit $?" >> "$R/compare.txt"
tail -3 "$R/compare.txt"
