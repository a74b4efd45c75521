#!/usr/bin/env bash
# The engine's figures in BENCHMARKS.md ("The rollout engine", "The engine against vLLM", "The
# engine on a busy machine", "Training"), each command's output into its own file here, headed by
# the command, the tree, the date and the machine. Run from the repository root on a quiet machine
# (stop anything else first; the sweeps pause with kill -STOP), with vLLM's CPU build in its own
# venv (DECISIONS.md: vLLM in the bench):  bash benchmarks/engine/run.sh [/path/to/vllm/python]
set -euo pipefail
VLLM=${1:-/work/vllm-venv/bin/python}
OUT=benchmarks/engine
MACHINE="$(nproc)-core $(lscpu | sed -n 's/^Model name: *//p' | head -1), flags: $(grep -o -w 'avx512f\|avx2\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
run() {  # NAME then the command
  local name=$1; shift
  local start=$SECONDS
  { echo "\$ $*"
    echo "# tree $(git rev-parse --short HEAD), $(date -u +%F), $MACHINE, load before $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=. "$@" 2>"$OUT/$name.stderr"
    echo "# whole command $((SECONDS - start)) s wall, load after $(cut -d' ' -f1 /proc/loadavg)"
  } > "$OUT/$name.txt"
  rm -f "$OUT/$name.stderr"
  echo "$name: $((SECONDS - start)) s"
}
run load python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8 --load 2 --json
run vllm-pairs python -m lab.bench --skip-baselines --vllm-python "$VLLM" --vllm-pairs 3 --json
run vllm-pairs-16x6 python -m lab.bench --skip-baselines --dialogues 16 --turns 6 --vllm-python "$VLLM" --vllm-pairs 3 --json
run profile python -m lab.bench --skip-baselines --vllm-python "$VLLM" --profile /tmp/bench-trace.json --json
run full python -m lab.bench --vllm-python "$VLLM" --json
run train-cpu python train.py --steps 3 --out /tmp/bench-train-cpu --overwrite
