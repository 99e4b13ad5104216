#!/usr/bin/env bash
# The GPU suite in two commands of under 10 minutes each, on a GPU machine that may have no network:
#   bash launch/gpu_suite.sh 1 OUT      # parts ops, speed, overhead
#   bash launch/gpu_suite.sh 2 OUT      # parts largest, quality (adds to OUT/suite.json)
#   bash launch/gpu_suite.sh 3 OUT [RECIPE,...]   # the quality part alone for 540 s (default: every recipe), e.g.
#       translation_multi30k: the recipes it runs replace their results in OUT/suite.json, the others stay
# then copy OUT into results/gpu/<date>-<device>/ and run `python -m harness results`.
# Wheels the machine lacks go in .whl/ (e.g. `pip wheel --no-deps deepspeed` and `pip download` of datasets and
# wandb with their dependencies, where there is network); they are installed into a private folder first.
# The benchmark data is read from $DATA (default .bench/, holding multi30k/, flip_ss/, flip_gb1/ and ett/).
# Set HARNESS_COMMIT to the commit when the tree is a copy without .git.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_suite.sh 1|2|3 OUT [RECIPE,...]}
out=${2:?usage: gpu_suite.sh 1|2|3 OUT [RECIPE,...]}
extra=()
case $part:$# in
  1:2) parts=ops,speed,overhead ;;
  2:2) parts=largest,quality ;;
  3:[23]) parts=quality; extra=(--budget quality=540 ${3:+--recipes "$3"}) ;;
  *) echo "usage: gpu_suite.sh 1|2 OUT, or gpu_suite.sh 3 OUT [RECIPE,...]" >&2; exit 2 ;;
esac
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/harness-site .whl/*.whl
  export PYTHONPATH=/tmp/harness-site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 -m harness bench suite --parts "$parts" --data "${DATA:-.bench}" --out "$out" ${extra[@]+"${extra[@]}"}
