set -u
R=$OUT/r; mkdir -p $R
export PYTHONPATH=/tmp/site
K="import sys; from kvxfer.cli import main; sys.exit(main())"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
cp REV $R/; nvidia-smi -L > $R/machine.txt
timeout 150 python3 -c "$K" bench --preset gpu --cases local_copy,ipc_kernel,local_rows,ipc,nixl_per_row,nixl_2p_packed --row-sizes 4K,64K \
  --request-bytes 64M --slots scattered,contiguous --latency-rows 32 --latency-samples 100 --no-overhead --no-progress \
  --json $R/check-64M.json --markdown $R/check-64M.md > $R/check-64M.log 2>&1; echo "bench rc=$?"; grep -ciE "error|differ" $R/check-64M.md
cd $OUT && tar czf r.tgz r && rm -rf r
