# Sourced by run_on_device.sh and run_multi_gpu.sh, from the repository root on a GPU host with no
# package registry: BCC from the bundle in .gpu/, memrec from the wheel in .gpu/ (missing dependencies
# from .gpu/wheels/), the GPU tests
# copied out of the tree (so the source folders do not shadow the installed package), and
# $RES for the results. Leaves the shell in /tmp with $repo naming the checkout.
set -u
OUT=${OUT:-/tmp/memrec-out}
RES=/tmp/memrec-results
mkdir -p "$OUT" "$RES"
repo=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .gpu/use-bcc-bundle.sh .gpu/bcc.tar.xz >/dev/null 2>&1 || { echo "BCC bundle failed"; exit 1; }
# Dependencies the image lacks travel as wheels in .gpu/wheels/ (pip download --python-version 3.12 ...).
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/memrec-*.whl $(ls .gpu/wheels/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1
rm -rf /tmp/gputests && cp -r "$repo/tests/gpu" /tmp/gputests
cd /tmp

# The tensor-truth run both tensor_truth.sh and stack_truth.sh make: worker p1 (started before the
# daemon), `memrec daemon ARGS... -o TRACE --socket SOCK` (its log in LOG), worker p2 (after the
# daemon), both let go at once and waited for. Leaves the daemon running: its pid in $d.
#     truth_run TRACE SOCK LOG ARGS...
truth_run() {
  local trace=$1 sock=$2 dlog=$3; shift 3
  python3 /tmp/gputests/tensor_truth.py worker $RES/p1 $RES/go &
  local p1=$!
  while [ ! -f $RES/p1/ready ]; do sleep 0.2; done
  echo "p1 (started before the daemon): pid $p1"
  python3 -m memrec daemon "$@" -o $trace --socket $sock --rotate-size 0 > $dlog 2>&1 &
  d=$!
  python3 -c "from memrec.subscriber import wait_for_daemon; wait_for_daemon('$sock', timeout=120)" || echo "daemon not up"
  echo "daemon up at $(date -u +%T)"
  python3 /tmp/gputests/tensor_truth.py worker $RES/p2 $RES/go &
  local p2=$!
  while [ ! -f $RES/p2/ready ]; do sleep 0.2; done
  echo "p2 (started after the daemon): pid $p2"
  sleep 1
  touch $RES/go
  wait $p1 $p2
}
