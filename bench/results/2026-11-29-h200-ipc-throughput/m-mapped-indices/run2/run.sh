# Run 2 (one H200, the kernel prefetching its next slots in a resident grid): build, native GPU tests in both index-staging modes, the in-process probe,
# the IPC breakdown, then an alternating A/B of `kvxfer bench`'s ipc case (one process per run).
set -u
R=$OUT/r; mkdir -p $R
D=bench/results/gpu-h200-mapped-indices-2026-11-29m
K="import sys; from kvxfer.cli import main; sys.exit(main())"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; lscpu | head -20 >> $R/gpu.txt
for m in mapped; do
  KVXFER_INDEX_STAGING=$m timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_native_gpu.py > $R/native-tests-$m.log 2>&1
  echo "tests $m: $(tail -1 $R/native-tests-$m.log)"
done
for m in upload mapped; do
  KVXFER_INDEX_STAGING=$m timeout 120 python3 $D/probe.py --out $R/probe-$m.json > $R/probe-$m.txt 2>&1; echo "probe $m rc=$?"
done
for m in mapped; do
  KVXFER_INDEX_STAGING=$m timeout 120 python3 bench/ipc_breakdown.py --cases 65536x4096,16384x16384,4096x65536 --reps 20 > $R/breakdown-$m.txt 2>&1; echo "breakdown $m rc=$?"
done
ab() {  # size round mode
  KVXFER_INDEX_STAGING=$3 timeout 150 python3 -c "$K" bench --preset gpu --cases local_copy,ipc --row-sizes 4K,16K,64K \
    --request-bytes $1 --memory device --slots scattered --directions push --no-latency --no-overhead \
    --no-progress --json $R/ab-$1-$2-$3.json > /dev/null 2>$R/ab-$1-$2-$3.err
  echo "ab $1 round $2 $3 rc=$?"
}
for r in 1 2; do
  if [ $r = 1 ]; then ab 256M $r upload; ab 256M $r mapped; else ab 256M $r mapped; ab 256M $r upload; fi
done
ab 1G 1 mapped; ab 1G 1 upload
