#!/usr/bin/env bash
# The GPU-truth validation in one go, on a GPU host with no package registry (the project's H200).
# From the repository root, with .gpu/ holding the BCC bundle (../shared/gpu/make-bcc-bundle.sh),
# use-bcc-bundle.sh and a memrec wheel (pip wheel --no-deps -w .gpu .):
#     OUT=/some/dir bash tests/gpu/run_on_device.sh [pytest -k EXPR]
# Writes $OUT/results.tgz: host.log, gpu-tests.log, latency.json, example traces and their reports.
source "$(dirname "$0")/device_env.sh"
{
  date -u
  uname -r
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, pynvml; from cuda import bindings; print(sys.version.split()[0], "torch", torch.__version__, "cuda-bindings", bindings.__version__)'
  python3 -m memrec doctor
} 2>&1 | tee "$RES/host.log"

python3 -m pytest -c /dev/null --rootdir /tmp/gputests -v -s -p no:cacheprovider /tmp/gputests ${1:+-k "$1"} \
  2>&1 | tee "$RES/gpu-tests.log"

# Example traces (kept in examples/ when small), each with its report.
for scenario in ipc expandable; do
  python3 -m memrec record -o "$RES/torch-$scenario.mrec" -- \
    python3 -m memrec.validation.gpu.torch_workloads "$scenario" --facts "$RES/torch-$scenario.json" >/dev/null 2>&1
  python3 -m memrec report "$RES/torch-$scenario.mrec" > "$RES/torch-$scenario.report.txt" 2>&1
done

# The SGLang stand-in (worked example of docs/sglang.md): without custom all-reduce buffers, with
# them built before the baseline as stock SGLang does (a few MiB), and with a forced 30 GiB build.
for v in base:"" stock:--stock-ar ipc:--ipc; do
  name=${v%%:*} flag=${v#*:}
  python3 -m memrec record -o "$RES/standin-$name.mrec" -- python3 -m memrec.validation.gpu.sglang_standin --tp 2 $flag > "$RES/standin-$name.log" 2>&1
  python3 -m memrec report "$RES/standin-$name.mrec" > "$RES/standin-$name.report.txt" 2>&1
done
python3 -m memrec diff "$RES/standin-base.mrec" "$RES/standin-stock.mrec" > "$RES/standin-diff-stock.txt" 2>&1
python3 -m memrec diff "$RES/standin-base.mrec" "$RES/standin-ipc.mrec" > "$RES/standin-diff-ipc.txt" 2>&1
tail -n 3 "$RES"/standin-*.log

python3 "$repo/bench/bench_gpu_latency.py" > "$RES/latency.json" 2> "$RES/latency.log"
tail -n 30 "$RES/latency.json"
ls -la "$RES"
tar czf "$OUT/results.tgz" -C "$RES" .
