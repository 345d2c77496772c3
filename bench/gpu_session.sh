#!/usr/bin/env bash
# One GPU session's checks, in one command (docs/bench.md): the cuda test tier, the whole suite, and the benches' CUDA
# rows, each bounded in time, logs under $OUT (or ./gpu_logs). Wheels of what the GPU image lacks (fastai and its
# helpers, for its Python) are installed from .whl/ when that folder is there.
#   bash bench/gpu_session.sh
set -u
out=${OUT:-gpu_logs}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg OMP_NUM_THREADS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, torchvision, fastai; print('python', sys.version.split()[0], 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'fastai', fastai.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/versions.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s): $*"; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?; echo "   rc=$rc in $((SECONDS-t0)) s"; grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -20; tail -n 3 "$out/$name.log"; }
step cuda_tier ${CUDA_LIMIT:-100} python3 -m pytest -q -p no:cacheprovider -n 0 -m cuda -rs
step suite ${SUITE_LIMIT:-260} python3 -m pytest -q -p no:cacheprovider --full -n 12 --maxprocesses 12 -rf --ignore=tests/test_notebooks.py -m "not slow and not cuda"
step noise_cost 35 python3 bench/noise_cost.py --device cuda --rounds 7
step precise_cost 35 python3 bench/precise_cost.py --device cuda --rounds 7
