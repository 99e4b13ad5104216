#!/usr/bin/env bash
# The GPU suite on a GPU machine that may have no network, in one command or in parts of under 10 minutes each:
#   bash launch/gpu_suite.sh all OUT [SECONDS]   # all a short lease allows in SECONDS (default 560): FusedAdam's
#       build, a 5-step GPU check that ends the command at once if training cannot run, speed (320 s), overhead
#       (90 s: its harness launch, given a third, needs about 25 s on an H200), then the translation recipe in what
#       is left (cut short and labelled so)
#   bash launch/gpu_suite.sh 1 OUT      # parts ops, speed, overhead
#   bash launch/gpu_suite.sh 2 OUT      # parts ops (CPU Adam for offload), largest, quality (adds to OUT/suite.json)
#   bash launch/gpu_suite.sh 3 OUT [RECIPE,...]   # the quality part alone for 540 s (default: every recipe), e.g.
#       translation_multi30k: the recipes it runs replace their results in OUT/suite.json, the others stay
# then copy OUT into results/gpu/<date>-<device>/ and run `python -m harness results`.
# Wheels the machine lacks go in .whl/ (e.g. `pip wheel --no-deps deepspeed` and `pip download` of datasets, wandb
# and tomli-w with their dependencies, where there is network); they are installed into a private folder first. The
# 5-step check of `all` names a missing one within a minute.
# The benchmark data is read from $DATA (default .bench/, holding multi30k/, flip_ss/, flip_gb1/ and ett/).
# Set HARNESS_COMMIT to the commit when the tree is a copy without .git.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
usage="usage: gpu_suite.sh all OUT [SECONDS] | 1 OUT | 2 OUT | 3 OUT [RECIPE,...]"
part=${1:?$usage}
out=${2:?$usage}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/harness-site .whl/*.whl
  export PYTHONPATH=/tmp/harness-site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
# SMOKE=1: the same steps at toy size, to try this script on a CPU first (without $DATA or .bench/: stand-in sets)
smoke=(); data=(--data "${DATA:-.bench}")
if [[ ${SMOKE:-0} == 1 ]]; then
  smoke=(--smoke)
  [[ -z ${DATA:-} && ! -d .bench ]] && data=()
fi
suite() { python3 -m harness bench suite ${data[@]+"${data[@]}"} --out "$out" ${smoke[@]+"${smoke[@]}"} "$@"; }
case $part:$# in
  1:2) suite --parts ops,speed,overhead; exit ;;
  2:2) suite --parts ops,largest,quality; exit ;;
  3:[23]) suite --parts quality --budget quality=540 ${3:+--recipes "$3"}; exit ;;
  all:[23]) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
deadline=$((start + ${3:-560}))
# GPU load and clocks every 2 s, beside the suite's own figures, stopped however the script ends
dmon=
if command -v nvidia-smi >/dev/null; then nvidia-smi dmon -s puc -d 2 >"$out/dmon.txt" 2>&1 & dmon=$!; fi
trap '[[ -z $dmon ]] || kill "$dmon" 2>/dev/null || true' EXIT
suite --parts ops
check=bench/gpu-check
python3 -m harness train --run configs/runs/lm_demo.toml --ds configs/ds/zero0.json --overwrite \
  --set train.max_steps=6 --set train.epochs=0.0 --set train.eval_every=0 --set train.save_every=0 \
  --set 'logging.backend="none"' --set logging.plots=false --set "run.output_dir=\"$check\"" --stop-at 5 \
  >"$out/check.log" 2>&1 || { tail -30 "$out/check.log"; echo "gpu_suite.sh: 5 steps of the lm failed: stopped"; exit 1; }
quality=$((deadline - SECONDS - 320 - 90 - 15))  # 15 s for the logs below
suite --parts speed,overhead,quality --recipes translation_multi30k --budget speed=320 --budget overhead=90 \
  --budget quality=$((quality > 0 ? quality : 0)) || true
# every run's log, profile and metrics (no weights or checkpoints), to read where a step's time went
tar czf "$out/logs.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.pt' --exclude='data' \
  bench/suite-work "$check" 2>/dev/null || true
echo "gpu_suite.sh: done in $((SECONDS - start)) s"
