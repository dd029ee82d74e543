# A/B of the index-upload chunk count (KVXFER_INDEX_CHUNKS), alternating, one process per run.
out=$1; rounds=$2
K="import sys; from kvxfer.cli import main; sys.exit(main())"
for size in 256M 1G; do
  for r in $(seq 1 $rounds); do
    for c in 8 3 2 1; do
      KVXFER_INDEX_CHUNKS=$c python3 -c "$K" bench --preset gpu --cases local_copy,ipc --row-sizes 4K,16K \
        --request-bytes $size --memory device --slots scattered --directions push --no-latency --no-overhead \
        --no-progress --json $out/chunks-$size-$r-c$c.json > /dev/null 2>$out/chunks-$size-$r-c$c.err
      echo "== $size round $r chunks $c rc=$?"
    done
  done
done
