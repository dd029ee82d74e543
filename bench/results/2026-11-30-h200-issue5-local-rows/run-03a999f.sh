set -u
R=$OUT/r; mkdir -p $R
export PYTHONPATH=/tmp/site
K="import sys; from kvxfer.cli import main; sys.exit(main())"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
cp REV $R/; nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu > $R/gpu-tests.log 2>&1; echo "tests rc=$? $(tail -n 1 $R/gpu-tests.log)"
timeout 200 python3 -c "$K" bench --preset gpu --cases local_copy,ipc_kernel,local_rows,ipc,nixl_one_desc,nixl_per_row,nixl_2p_packed \
  --row-sizes 4K,64K --request-bytes 256M --slots scattered --latency-rows 32 --latency-samples 300 --no-overhead --no-progress \
  --json $R/bench-256M.json --markdown $R/bench-256M.md > $R/bench-256M.log 2>&1; echo "bench rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
