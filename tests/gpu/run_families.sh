#!/usr/bin/env bash
# Issue 21 on the GPU host in one call: what each family costs by NVML (explore_families.py, raw),
# memrec's attribution of each scenario (test_families_gpu.py), the graph-launch time with and
# without the recorder, and the untraced probes' cost on NCCL's init (bench_untraced_probes.py).
#     OUT=/some/dir [BENCH=dir of bench_untraced_probes.py] bash tests/gpu/run_families.sh
source "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/explore"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$OUT/host.log" 2>&1
timeout 100 python3 /tmp/gputests/explore_families.py "$OUT/explore" --count > "$OUT/explore.log" 2>&1
echo "explore rc $?" >> "$OUT/host.log"
timeout 150 python3 -m pytest -c /dev/null --rootdir /tmp/gputests -v -s -p no:cacheprovider \
  /tmp/gputests/test_families_gpu.py > "$OUT/families-tests.log" 2>&1
echo "tests rc $?" >> "$OUT/host.log"
for i in 1 2; do
  timeout 30 python3 -m memrec.validation.gpu.family_workloads graph_launches 2>&1 | head -1 | sed 's/^/none /'
  timeout 60 python3 -m memrec record -o /tmp/gl.mrec -- python3 -m memrec.validation.gpu.family_workloads graph_launches 2>&1 \
    | grep graph_launch_us | sed 's/^/memrec /'
done > "$OUT/graph-launches.log" 2>&1
timeout 90 python3 "${BENCH:-$repo/bench}/bench_untraced_probes.py" --workloads nccl --setups core,untraced \
  --repeat 10 > "$OUT/bench.json" 2> "$OUT/bench.err"
echo "bench rc $?" >> "$OUT/host.log"
tail -n 5 "$OUT/host.log"; grep -E "PASS|FAIL|Error" "$OUT/families-tests.log" | tail -12; cat "$OUT/graph-launches.log"
tail -n 25 "$OUT/bench.err"
