# Does the GPU machine's CPU idle handling make a publish that follows a wait slow ("cold")?
# Prints the guest's cpuidle/cpufreq settings, then runs the IPC breakdown (256 MiB of 64 KiB rows, and the
# 32-row request with busy_poll) and kvxfer bench's 32-row latency, as the machine comes, then with every
# cpuidle state but the polling one disabled (if the guest lets us), then as it came again.
set -u
R=$OUT/r; mkdir -p $R
K="import sys; from kvxfer.cli import main; sys.exit(main())"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/build.log 2>&1; echo "build rc=$?"
{
  echo "== lscpu"; lscpu | head -25
  echo "== cpuidle driver/governor"; cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor* 2>&1
  echo "== cpu0 idle states"; for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "$s: $(cat $s/name) latency=$(cat $s/latency) disable=$(cat $s/disable) usage=$(cat $s/usage) time=$(cat $s/time)"; done 2>&1
  echo "== haltpoll params"; grep -H . /sys/module/haltpoll/parameters/* /sys/module/cpuidle_haltpoll/parameters/* 2>&1
  echo "== cpufreq"; ls /sys/devices/system/cpu/cpu0/cpufreq 2>&1; grep -H . /sys/devices/system/cpu/cpu0/cpufreq/scaling_* 2>&1
  echo "== cmdline"; cat /proc/cmdline
} > $R/system.txt 2>&1
set_idle() {  # 1: disable every state but state0 (POLL); 0: enable all
  for f in /sys/devices/system/cpu/cpu*/cpuidle/state[1-9]*/disable; do echo $1 > $f 2>>$R/idle-set.err; done
  echo "idle states disabled=$1: $(cat /sys/devices/system/cpu/cpu0/cpuidle/state*/disable 2>/dev/null | tr '\n' ' ')"
}
one() {  # tag
  timeout 120 python3 bench/ipc_breakdown.py --cases 4096x65536,32x65536 --reps 20 --small-reps 300 --busy-poll > $R/breakdown-$1.txt 2>&1
  timeout 120 python3 -c "$K" bench --preset gpu --cases ipc_busy_poll --no-throughput --no-overhead --latency-rows 32 \
    --latency-samples 1000 --no-progress --json $R/latency-$1.json > $R/latency-$1.log 2>&1
  timeout 120 python3 -c "$K" bench --preset gpu --cases local_copy,ipc --row-sizes 4K,64K --request-bytes 256M --memory device \
    --slots scattered --directions push --no-latency --no-overhead --no-progress --json $R/ipc-$1.json > /dev/null 2>&1
  echo "$1 done"
}
one default-1
set_idle 1; one poll-only-1
set_idle 0; one default-2
set_idle 1; one poll-only-2
set_idle 0
