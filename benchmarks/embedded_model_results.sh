#!/usr/bin/env bash
# The figures of docs/model-card.md and the README for the embedded model, on this machine.
# Two lanes run side by side, one CPU thread each: the evaluations (accuracy on held-out arith
# problems) and `fastdllm bench` (the paper's table, speed-ups measured within one process).
# Usage: bash benchmarks/embedded_model_results.sh [OUT_DIR]   (about 30 minutes on 2 CPU cores)
#        DREAM=0 bash benchmarks/embedded_model_results.sh ...   skips the Dream twin's two evaluations
set -euo pipefail
out=${1:-docs/results}
mkdir -p "$out"
ev() { name=$1; shift; python -m fastdllm eval --task arith --threads 1 --batch-size 16 --no-progress \
         --output "$out/eval_$name.json" "$@"; }
(
  ev baseline_256    --limit 500 --gen-length 256 --preset baseline
  ev full_256        --limit 500 --gen-length 256 --preset fast-dllm
  ev default_256     --limit 500 --gen-length 256
  ev threshold07_256 --limit 500 --gen-length 256 --preset fast-dllm --threshold 0.7
  ev threshold05_256 --limit 500 --gen-length 256 --preset fast-dllm --threshold 0.5
  # Gen length 1024 on the same 500 problems as the gen-256 rows, so the gap compares like with like.
  ev full_1024_8shot --limit 500 --gen-length 1024 --num-fewshot 8 --preset fast-dllm
  # 0-shot at gen length 1024 too, to tell the long answer region from the 8-shot prompt.
  ev full_1024       --limit 500 --gen-length 1024 --preset fast-dllm
) > "$out/evals.log" 2>&1 &
evals=$!
(
  python -m fastdllm bench --threads 1 --gen-length 256 --limit 16 --out "$out/bench"
  # Gen length 1024, 8-shot: one-token-per-step decoding costs ~4 CPU-minutes per problem here,
  # so only the baseline and the full method run, on two problems.
  python -m fastdllm bench --threads 1 --gen-length 1024 --limit 2 --rows full --no-sweeps --no-batch-check \
    --out "$out/bench_1024"
  # The Dream-format twin: Dream's own decoding (entropy-ordered, one token per step, block 32), and
  # the full method on top of it.
  if [ "${DREAM:-1}" != 0 ] && [ -d fastdllm/embedded/assets/dream-arith ]; then
    ev dream_baseline_256 --model dream-arith --limit 500 --gen-length 256 --preset baseline --alg entropy
    ev dream_full_256     --model dream-arith --limit 500 --gen-length 256 --preset fast-dllm --alg entropy
    ev dream_default_256  --model dream-arith --limit 500 --gen-length 256 --alg entropy
  fi
) > "$out/bench.log" 2>&1
wait $evals
cat "$out/evals.log"
