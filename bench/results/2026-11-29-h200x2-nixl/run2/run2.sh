# Run 2: A = main's kvxfer (0a4b7fd: arena 512 MiB in 32 MiB slots), B = the probe (inline-gather-post.diff plus
# the 1 GiB / 64 MiB device arena default); .gpuwt the probe's tree, .gpuwm main's kvxfer/. The native module is
# the same in both (built once). Bench runs from /tmp so that neither tree's source shadows the installed one.
W=$PWD/.gpuwt; R=$OUT/r; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT r; }
cd $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/siteB . > $R/build.log 2>&1 || echo build failed >> $R/build.log
mkdir -p /tmp/siteA && cp -r /tmp/siteB/kvxfer /tmp/siteA/ && cp -r ../.gpuwm/kvxfer/. /tmp/siteA/kvxfer/
cp /tmp/siteB/kvxfer/_native*.so kvxfer/ 2>> $R/build.log
for v in A B; do (cd /tmp && PYTHONPATH=/tmp/site$v:/tmp/site python3 -c "import kvxfer.native as n, kvxfer.backends.nixl as x; print('$v', n.info(), x.ARENA_DEFAULTS)") >> $R/build.log 2>&1; done
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/machine.txt; nproc >> $R/machine.txt; cat REV >> $R/machine.txt
run() { name=$1; v=$2; shift 2; echo "== $name [$v]: $*" >> $R/ab.txt
  (cd /tmp && PYTHONPATH=/tmp/site$v:/tmp/site timeout 100 python3 $W/bench/nixl_packed.py --memory device --devices 0,1 --paths packed --reps 5 "$@" --json $R/$name.json >> $R/ab.txt 2>&1) || echo "rc=$?" >> $R/ab.txt; }
for r in 1 2; do
  if [ $r = 1 ]; then order="A A1024 B"; else order="B A1024 A"; fi
  for v in $order; do case $v in
    A) run 256M-A-r$r A --rows 4096;;
    A1024) run 256M-A1024-r$r A --rows 4096 --arena-mib 1024 --packed-chunk-mib 64;;
    B) run 256M-B-r$r B --rows 4096;; esac; done; pack
done
run 1G-A A --rows 16384; run 1G-A1024 A --rows 16384 --arena-mib 1024 --packed-chunk-mib 64; run 1G-B B --rows 16384; pack
PYTHONPATH=/tmp/site timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_nixl_packed_gpu.py tests/gpu/test_nixl_gpu.py > $R/gpu-tests.log 2>&1; echo "rc=$?" >> $R/gpu-tests.log; pack
run 256M-4K-A1024 A --rows 65536 --row-bytes 4096 --arena-mib 1024 --packed-chunk-mib 64; run 256M-4K-B B --rows 65536 --row-bytes 4096; pack
