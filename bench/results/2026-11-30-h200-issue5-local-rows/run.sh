set -u
R=$OUT/r; mkdir -p $R
export PYTHONPATH=/tmp/site
K="import sys; from kvxfer.cli import main; sys.exit(main())"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
# First, before the editable install (its import redirect would win): the GIL test against the bindings before this session (9a921b6's module.cpp): must fail there.
rm -rf /tmp/old && mkdir /tmp/old && cp -r CMakeLists.txt pyproject.toml README.md native bindings kvxfer tests /tmp/old/ && cp old_module.cpp /tmp/old/bindings/module.cpp
(cd /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite . > $R/build-old.log 2>&1); echo "old build rc=$?"
(cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site python3 -m pytest -q -m gpu -p no:cacheprovider -rs /tmp/old/tests/gpu/test_native_gpu.py -k page_locking > $R/gil-test-old-bindings.log 2>&1; echo "old: $(tail -n 1 $R/gil-test-old-bindings.log)")
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
cp REV $R/; nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu/test_native_gpu.py -k "page_locking or doorbell" > $R/gil-test-new.log 2>&1; echo "new: $(tail -n 1 $R/gil-test-new.log)"
timeout 240 python3 -c "$K" bench --preset gpu --cases local_copy,ipc_kernel,local_rows,ipc,ipc_busy_poll --row-sizes 4K,16K,64K \
  --request-bytes 256M --slots scattered --latency-rows 32 --latency-samples 500 --no-overhead --no-progress \
  --json $R/issue5-256M.json --markdown $R/issue5-256M.md > $R/issue5-256M.log 2>&1; echo "bench rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
