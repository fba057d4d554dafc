#!/usr/bin/env bash
# The GPU checks on the H200, in one command, from the checkout's root: bash benchmarks/h200.sh
# (see ../shared/device/README.md for the machine):
#   GPU op tests of both backends, the ops benchmark, and sweeps of both backends against the
#   reference backend (KL, top-1, speed) on smollm2 and random-weight Qwen3-0.6B/4B-shaped models.
# Needs: the cuTile toolchain and the Python deps installed in /tmp/tile (device bundles), the
# SmolLM2 GGUF in $TILEINFER_HOME, a Qwen tokenizer folder in $QWEN_TOKENIZER. Writes $OUT/h200.tar.gz.
# Optional: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_PROFILE=0 (the ncu profile, ~2.5 min), BACKENDS=triton,cutile, QUANTS=bf16,int8_both, and STREAMS=DIR (a
# runs/cache folder of an earlier run: its recorded base side is reused instead of computed again).
set -u
export PYTHONPATH=/tmp/tile/site PATH=/tmp/tile/cu13/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset CUDA_HOME CUDA_PATH
R=$OUT/h200; mkdir -p $R
n=0
step() { local t=$1; shift; n=$((n+1)); echo "== $* (limit ${t}s)"; timeout "$t" "$@" > "$R/step$n.log" 2>&1; echo "   exit $?"; }
# installed (editable, no dependencies) so that conf/ is importable as tileinfer.conf (the model registry)
python -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
python -m tileinfer.pull smollm2-135m || exit 1
step 30 python -m benchmarks.aot --backend cutile --jobs 16
[ "${SKIP_TESTS:-0}" = 1 ] || step 300 python -m pytest -q -m gpu tests -p no:cacheprovider  # serially: parallel workers share the GPU and ran out of memory
[ "${SKIP_BENCH:-0}" = 1 ] || step 130 python -m benchmarks.ops --backends triton,cutile --precompile 16 --budget 90 --out $R/bench
[ "${SKIP_PROFILE:-1}" = 1 ] || step 200 python -m benchmarks.profile --backends triton,cutile,torch --out $R/profile --timeout 190
[ -n "${STREAMS:-}" ] && mkdir -p $R/runs && cp -r "$STREAMS" $R/runs/cache
# each backend against the reference backend with the same quant config (the gate's kernel checks)
S="-m backend=${BACKENDS:-triton,cutile} quant=${QUANTS:-bf16,int8_both} ctx=1k base.backend=reference base.quant=same eval.n_score=128 speed.decode_tokens=64 runs_dir=$R/runs"
step 120 python -m tileinfer.sweep $S model=smollm2-135m
step 110 python -m tileinfer.sweep $S model=qwen3-0.6b-random model.source.random.tokenizer=$QWEN_TOKENIZER
step 170 python -m tileinfer.sweep $S model=qwen3-4b-random model.source.random.tokenizer=$QWEN_TOKENIZER
tail -n 3 $R/*.log
rm -f $R/profile/profile.ncu-rep  # too large to bring back; ncu_raw.csv holds its metrics
tar czf $OUT/h200.tar.gz -C $OUT h200 && rm -rf $R
