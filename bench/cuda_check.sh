#!/usr/bin/env bash
# The checks that need a GPU, in one go (a lent GPU machine's time is short):
#   1. the CUDA tests (tests/runtime/test_cuda.py) and the trainer tests, which pick
#      CUDA by themselves on a machine that has it;
#   2. examples/digits.yaml and examples/ctr.yaml under `pstrain run`, the workers on the
#      GPU (nvidia-smi's list of compute processes, sampled each second, shows them);
#   3. `python -m bench --only gpu`: the worker step on CUDA, split into its parts.
# Logs and results go to $OUT (default /tmp/cuda-check). Run from the repository root,
# with pstrain installed or not: wheels in .whl/ (Python packages that machine lacks)
# are installed first, and the sources are put on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/api:$PWD/runtime:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda:", torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'

echo "== 1. tests (one pytest per file: a failing file cannot eat the others' time)"
for f in test_cuda test_rt_trainer test_sparse_trainer test_ctr_example test_sparse_cache \
         test_sparse_fusion test_rt_checkpoint test_rt_export test_sparse_local; do
    timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 45 --tb=short -rfE \
        "tests/runtime/$f.py" >"$OUT/$f.log" 2>&1
    echo "$f rc=$?: $(tail -n 1 "$OUT/$f.log")"
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/test_*.log | head -n 20

echo "== 2. examples under pstrain run"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -l 1 \
    >"$OUT/gpu-apps.csv" 2>&1 &
smi=$!
for job in digits ctr; do
    timeout 180 python3 -m pstrain_api.cli run --quiet --json "examples/$job.yaml" \
        >"$OUT/$job.json" 2>"$OUT/$job.log"
    echo "$job rc=$?: $(tail -c 600 "$OUT/$job.json")"
done
kill "$smi" 2>/dev/null
echo "GPU processes seen: $(sort -u -t, -k1,1 "$OUT/gpu-apps.csv" | wc -l)"
sort -t, -k3 -n -r "$OUT/gpu-apps.csv" | head -n 4

echo "== 3. bench: the worker step on CUDA"
timeout 240 python3 -m bench --only gpu --out "$OUT/bench" >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "^\[bench\]   gpu" "$OUT/bench.log"
