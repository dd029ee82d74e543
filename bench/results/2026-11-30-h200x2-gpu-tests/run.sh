set -u
R=$OUT/r; mkdir -p $R
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
cp REV $R/; nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
timeout ${T:-500} python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=15 ${TESTS:-tests/gpu} > $R/gpu-tests.log 2>&1; echo "tests rc=$? $(tail -n 1 $R/gpu-tests.log)"
cd $OUT && tar czf r.tgz r && rm -rf r
