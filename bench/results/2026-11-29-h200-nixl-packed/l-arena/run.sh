R=$OUT/r; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT r; }
cd .gpuwt
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1
cp REV $R/; nproc > $R/machine.txt; nvidia-smi --query-gpu=name,driver_version --format=csv >> $R/machine.txt
timeout 300 python3 -m pytest -q -m gpu tests/gpu > $R/gpu-tests.log 2>&1; echo "rc=$?" >> $R/gpu-tests.log; pack
B="python3 bench/nixl_packed.py --memory device --paths packed --reps 5"
for rows in 4096 16384; do
  echo "== rows $rows, 512/32" >> $R/one-gpu.txt; timeout 80 $B --rows $rows --arena-mib 512 --packed-chunk-mib 32 --json $R/one-gpu-$rows-a512.json >> $R/one-gpu.txt 2>&1
  echo "== rows $rows, default (1024/64)" >> $R/one-gpu.txt; timeout 80 $B --rows $rows --json $R/one-gpu-$rows-default.json >> $R/one-gpu.txt 2>&1
  pack
done
