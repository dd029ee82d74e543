R=$OUT/r; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT r; }
cd .gpuwt
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1
cp REV $R/; nproc > $R/machine.txt; nvidia-smi --query-gpu=name,driver_version --format=csv >> $R/machine.txt
python3 -c "import gc; print('gc enabled (plain):', gc.isenabled())" >> $R/machine.txt
PYTHONPATH=$PWD/gcoff:/tmp/site python3 -c "import gc; print('gc enabled (gcoff):', gc.isenabled())" >> $R/machine.txt
K="import sys; from kvxfer.cli import main; sys.exit(main())"
lat() { name=$1; pp=$2; PYTHONPATH=$pp timeout 120 python3 -c "$K" bench --preset gpu --cases ipc_busy_poll,ipc --no-throughput --no-overhead --latency-rows 32 --latency-samples 1000 --no-progress --json $R/$name.json > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; }
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then lat gc-on-$r /tmp/site; lat gc-off-$r $PWD/gcoff:/tmp/site
  else lat gc-off-$r $PWD/gcoff:/tmp/site; lat gc-on-$r /tmp/site; fi
  pack
done
