# A/B of the index-staging fill helpers (KVXFER_FILL_HELPERS), alternating, one process per run.
out=$1; rounds=$2
K="import sys; from kvxfer.cli import main; sys.exit(main())"
for size in 256M 1G; do
  for r in $(seq 1 $rounds); do
    for h in 3 7 1; do
      KVXFER_FILL_HELPERS=$h python3 -c "$K" bench --preset gpu --cases local_copy,ipc --row-sizes 4K,16K \
        --request-bytes $size --memory device --slots scattered --directions push --no-latency --no-overhead \
        --no-progress --json $out/helpers-$size-$r-h$h.json > /dev/null 2>$out/helpers-$size-$r-h$h.err
      echo "== $size round $r helpers $h rc=$?"
    done
  done
done
