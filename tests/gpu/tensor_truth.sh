#!/usr/bin/env bash
# Tensor blocks on the H200 (docs/validation/): two PyTorch processes, one started before the
# daemon, traced with `memrec daemon --tensors` and compared with PyTorch's own memory history;
# then the cost, as ratios within this one run. From the repository root:
#     OUT=/some/dir bash tests/gpu/tensor_truth.sh
source "$(dirname "$0")/device_env.sh"
T=/tmp/gputests/tensor_truth.py
log=$RES/tensor-truth.log
{
date -u; uname -r
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
python3 -m memrec doctor 2>&1 | grep -i -A3 "torch\|tensor" | head -20
echo "== cost without the daemon"
python3 $T cost none
truth_run $RES/tensors.mrec /tmp/tt.sock $RES/daemon.log --tensors
echo "== cost with the daemon --tensors"
python3 $T cost tensors
kill -INT $d; wait $d
echo "daemon exit $?"
grep -i "torch\|tensor\|libc10" $RES/daemon.log | head -10
echo "== PyTorch's history against memrec's trace"
python3 $T compare $RES/tensors.mrec $RES/p1 $RES/p2
python3 -m memrec report $RES/tensors.mrec > $RES/tensors.report.txt 2>&1
sed -n '/tensor blocks/,/^$/p' $RES/tensors.report.txt | head -40
echo "== cost with the daemon, no --tensors"
python3 -m memrec daemon -o $RES/plain.mrec --socket /tmp/tp.sock --rotate-size 0 > $RES/daemon-plain.log 2>&1 &
d=$!
python3 -c "from memrec.subscriber import wait_for_daemon; wait_for_daemon('/tmp/tp.sock', timeout=120)" || echo "daemon not up"
python3 $T cost plain
kill -INT $d; wait $d
echo "== cost without the daemon, again"
python3 $T cost none2
date -u
} 2>&1 | tee $log
ls -la $RES
tar -czf $OUT/tensor-truth.tgz -C $RES tensor-truth.log tensors.report.txt daemon.log daemon-plain.log p1 p2 2>/dev/null
cp $log $OUT/
