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
