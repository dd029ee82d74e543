# Run 1 (code at 0a4b7fd plus this session's bench/nixl_packed.py --devices; kvxfer/backends/nixl_packed.py's
# PREGRANT_SLOTS made readable from KVXFER_PREGRANT for this run only:
#   sed -i 's/^PREGRANT_SLOTS = 4 /PREGRANT_SLOTS = int(__import__("os").environ.get("KVXFER_PREGRANT", "4")) /')
set -x
cd .gpuwt
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/build.log 2>&1
R=$OUT/r; mkdir -p $R
nvidia-smi topo -m > $R/topo.txt 2>&1
nproc > $R/machine.txt; nvidia-smi --query-gpu=name,driver_version --format=csv >> $R/machine.txt
B="python3 bench/nixl_packed.py --memory device --devices 0,1 --poll-us 100 --paths packed --reps 5"
run() { name=$1; shift; echo "== $name: $*" | tee -a $R/sweep.txt; timeout 120 env "$@" --json $R/$name.json >> $R/sweep.txt 2>&1 || echo "rc=$?" >> $R/sweep.txt; }
run 256M-a512-c32-p4 $B --rows 4096
run 256M-a1024-c64-p4 $B --rows 4096 --arena-mib 1024 --packed-chunk-mib 64
run 256M-a1024-c128-p4 $B --rows 4096 --arena-mib 1024 --packed-chunk-mib 128
run 256M-a1024-c32-p8 KVXFER_PREGRANT=8 $B --rows 4096 --arena-mib 1024 --packed-chunk-mib 32
run 256M-a1024-c64-p4-poll0 $B --rows 4096 --arena-mib 1024 --packed-chunk-mib 64 --poll-us 0
run 1G-a512-c32-p4 $B --rows 16384
run 1G-a1024-c64-p4 $B --rows 16384 --arena-mib 1024 --packed-chunk-mib 64
run 1G-a2048-c128-p8 KVXFER_PREGRANT=8 $B --rows 16384 --arena-mib 2048 --packed-chunk-mib 128
timeout 120 python3 bench/nixl_packed_timeline.py --devices 0,1 --reps 3 > $R/timeline-256M-a512-c32.txt 2>&1
timeout 120 python3 bench/nixl_packed_timeline.py --devices 0,1 --reps 3 --arena-mib 1024 --chunk-mib 64 > $R/timeline-256M-a1024-c64.txt 2>&1
cd $OUT && tar czf r.tgz r && rm -rf r
