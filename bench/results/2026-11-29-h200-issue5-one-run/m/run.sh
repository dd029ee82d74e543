# Issue 5's set at 9a1aca3 on one H200: the GPU test suite, then kvxfer bench --preset gpu (every case of the issue in
# one run) at 256 MiB and at 1 GiB.
set -u
R=$OUT/r; mkdir -p $R
K="import sys; from kvxfer.cli import main; sys.exit(main())"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
cp REV $R/
[ "${TESTS:-1}" = 1 ] && timeout 260 python3 -m pytest -q -m gpu tests/gpu > $R/gpu-tests.log 2>&1; echo "tests: $(tail -1 $R/gpu-tests.log)"
for size in ${SIZES:-256M 1G}; do
  timeout 280 python3 -c "$K" bench --preset gpu --request-bytes $size --no-progress --json $R/issue5-$size.json \
    --markdown $R/issue5-$size.md > $R/issue5-$size.log 2>&1; echo "bench $size rc=$?"
done
