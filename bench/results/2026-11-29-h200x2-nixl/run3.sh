R=$OUT/r; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT r; }
cd .gpuwt
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1
cp REV $R/
K="python3 -c 'import sys; from kvxfer.cli import main; sys.exit(main())'"
for size in 1G 256M; do
  timeout 250 bash -c "$K bench --preset gpu2 --cases local_copy,nixl_per_row,nixl_2p_packed --slots scattered --directions push --memory device --row-sizes 4K,16K,64K --request-bytes $size --max-descriptors 20000 --no-latency --no-overhead --no-progress --json $R/gpu2-packed-$size.json --markdown $R/gpu2-packed-$size.md" > $R/bench-$size.log 2>&1; echo "rc=$?" >> $R/bench-$size.log; pack
done
timeout 90 python3 bench/nixl_packed_timeline.py --devices 0,1 --reps 3 --rows 16384 --arena-mib 1024 --chunk-mib 64 > $R/timeline-1G.txt 2>&1; pack
