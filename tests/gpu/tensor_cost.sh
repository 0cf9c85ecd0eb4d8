#!/usr/bin/env bash
# The cost of `memrec daemon --tensors` on the H200, as ratios within one run (docs/performance.md):
# bench/bench_tensor_cost.py (one PyTorch worker; no daemon, the daemon without --tensors and with
# it, interleaved over ROUNDS rounds: a launch-bound and a GPU-bound transformer's training steps
# and a tight torch.empty/del loop), then bench/bench_tensor_probes.py (the probe hit on the stub:
# 1-byte vs 5-byte nop sites). From the repository root, with the bench folder in $BENCH:
#     OUT=/some/dir BENCH=.dev-NAME/bench [CONFIGS=none,tensors,self,other] bash tests/gpu/tensor_cost.sh [ROUNDS]
# (CONFIGS: bench_tensor_cost.py's --configs; default none,plain,tensors)
BENCH=$(realpath "${BENCH:-bench}")
source "$(dirname "$0")/device_env.sh"
rounds=${1:-10}
log=$RES/tensor-cost.log
{
date -u; uname -r; nproc
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
# A first daemon start compiles the probe program (with --tensors: the larger one) into the probe
# cache; do it before the rounds so no round pays it.
for opt in "" --tensors; do
  python3 -m memrec daemon -o /tmp/warm.mrec --socket /tmp/warm.sock --rotate-size 0 $opt > $RES/warm-daemon.log 2>&1 &
  d=$!
  python3 -c "from memrec.subscriber import wait_for_daemon; wait_for_daemon('/tmp/warm.sock', timeout=300)" || echo "daemon not up"
  kill -INT $d; wait $d
done
rm -f /tmp/warm.mrec
echo "== bench_tensor_cost ($rounds rounds)"
python3 $BENCH/bench_tensor_cost.py --rounds $rounds --configs ${CONFIGS:-none,plain,tensors} --json $RES/tensor-cost.json || echo "bench_tensor_cost failed"
echo "== bench_tensor_probes (stub libc10_cuda.so)"
python3 $BENCH/bench_tensor_probes.py --pairs 200000 --repeat 10 || echo "bench_tensor_probes failed"
date -u
} 2>&1 | tee $log
cp $log $RES/tensor-cost.json $OUT/ 2>/dev/null
true
