#!/usr/bin/env bash
# The multi-GPU validation in one go (nvidia-h200-x2 or larger), set up as run_on_device.sh is.
#     OUT=/some/dir bash tests/gpu/run_multi_gpu.sh
# Writes $OUT/results.tgz: host.log, multi-gpu-tests.log, the seed-case traces, reports and diff.
source "$(dirname "$0")/device_env.sh"
{
  date -u
  uname -r
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -m memrec doctor
} 2>&1 | grep -v "SyntaxWarning\|elif re.match" | tee "$RES/host.log"

MEMREC_KEEP_TRACES=$RES python3 -m pytest -c /dev/null --rootdir /tmp/gputests -v -s -p no:cacheprovider /tmp/gputests/test_multi_gpu.py \
  2>&1 | grep -v "SyntaxWarning\|elif re.match" | tee "$RES/multi-gpu-tests.log"

# The seed case as far as real CUDA allows: SGLang-shaped startup, one rank per GPU, without and
# with all-reduce-style IPC buffers; memrec diff says which phase and buffers changed the budget.
for mode in base ipc; do
  flag=""; [ "$mode" = ipc ] && flag="--ipc"
  python3 -m memrec record -o "$RES/seed-$mode.mrec" -- python3 -m memrec.validation.gpu.sglang_standin --tp 2 --weights-gib 60 --ipc-gib 30 $flag \
    > "$RES/seed-$mode.log" 2>&1
  python3 -m memrec report "$RES/seed-$mode.mrec" > "$RES/seed-$mode.report.txt" 2>&1
done
python3 -m memrec diff "$RES/seed-base.mrec" "$RES/seed-ipc.mrec" > "$RES/seed.diff.txt" 2>&1
tail -n 2 "$RES"/seed-*.log
head -n 40 "$RES/seed.diff.txt"
tar czf "$OUT/results.tgz" -C "$RES" .
