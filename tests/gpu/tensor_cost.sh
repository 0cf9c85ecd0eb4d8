#!/usr/bin/env bash
# The cost of `memrec daemon --tensors` on the H200, as ratios within one run (docs/performance.md):
# an eager transformer's training steps and a tight torch.empty/del loop, with no daemon, the
# daemon without --tensors and the daemon with it, interleaved over rounds; then the probe-hit
# bench on the stub (1-byte vs 5-byte nop sites). From the repository root:
#     OUT=/some/dir bash tests/gpu/tensor_cost.sh [ROUNDS]
source "$(dirname "$0")/device_env.sh"
T=/tmp/gputests/tensor_truth.py
rounds=${1:-3}
log=$RES/tensor-cost.log
daemon_run() {  # $1: label, $2...: daemon options
  local label=$1; shift
  python3 -m memrec daemon -o $RES/cost-$label.mrec --socket /tmp/tc.sock --rotate-size 0 "$@" > $RES/cost-daemon.log 2>&1 &
  local d=$!
  python3 -c "from memrec.subscriber import wait_for_daemon; wait_for_daemon('/tmp/tc.sock', timeout=120)" || echo "daemon not up"
  python3 $T cost $label
  kill -INT $d; wait $d
  rm -f $RES/cost-$label.mrec
}
{
date -u; uname -r; nproc
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
for r in $(seq $rounds); do
  echo "== round $r"
  python3 $T cost none
  daemon_run plain
  daemon_run tensors --tensors
done
echo "== probe-hit bench (stub libc10_cuda.so)"
cp -r $repo/.dev-tensors/bench /tmp/tbench 2>/dev/null
python3 /tmp/tbench/bench_tensor_probes.py --pairs 200000 --repeat 5 || echo "bench failed"
date -u
} 2>&1 | tee $log
cp $log $OUT/
