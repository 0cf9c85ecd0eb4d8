#!/usr/bin/env bash
# Stacks on the H200 (docs/validation/): two PyTorch processes, one started before the daemon,
# traced with `memrec daemon --tensors --stacks`, compared with PyTorch's own memory history
# (blocks both ways, and the innermost user Python frame of every block >= 4 KiB); then the SGLang
# stand-in's start-up under the daemon without and with --stacks, alternating. From the repo root:
#     OUT=/some/dir bash tests/gpu/stack_truth.sh
source "$(dirname "$0")/device_env.sh"
T=/tmp/gputests/tensor_truth.py
log=$RES/stack-truth.log
daemon_up() { python3 -c "from memrec.subscriber import wait_for_daemon; wait_for_daemon('$1', timeout=120)" || echo "daemon not up"; }
{
date -u; uname -r
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
python3 -m memrec doctor 2>&1 | grep -i -A2 "python stacks\|tensor blocks" | head -12
truth_run $RES/stacks.mrec /tmp/st.sock $RES/daemon.log --tensors --stacks --stack-min-bytes 4096
sleep 1
kill -INT $d; wait $d
echo "daemon exit $?"
grep -i "stack\|python\|interpreter" $RES/daemon.log | head -10
python3 -c "
from memrec.trace.reader import load_trace
t = load_trace('$RES/stacks.mrec'); print('trailer stacks:', t.trailer.get('stacks_read'))"
echo "== PyTorch's history against memrec's trace: blocks"
python3 $T compare $RES/stacks.mrec $RES/p1 $RES/p2
echo "== PyTorch's history against memrec's trace: innermost user frames"
python3 $T stacks $RES/stacks.mrec $RES/p1 $RES/p2
python3 -m memrec report $RES/stacks.mrec > $RES/stacks.report.txt 2>&1
echo "== SGLang stand-in start-up (--tp 1 --weights-gib 8): daemon without / with --stacks, alternating"
for round in $(seq ${STANDIN_ROUNDS:-5}); do
  for mode in plain stacks; do
    flag=""; [ $mode = stacks ] && flag="--stacks"
    python3 -m memrec daemon $flag -o $RES/standin-$mode-$round.mrec --socket /tmp/sd.sock --rotate-size 0 \
      > $RES/daemon-standin-$mode-$round.log 2>&1 &
    d=$!
    daemon_up /tmp/sd.sock
    t0=$(date +%s.%N)
    python3 -m memrec.validation.gpu.sglang_standin --tp 1 --weights-gib 8 > $RES/standin-$mode-$round.log 2>&1
    rc=$?
    t1=$(date +%s.%N)
    kill -INT $d; wait $d
    echo "standin $mode round $round: rc $rc, $(python3 -c "print(f'{$t1 - $t0:.3f}')") s"
  done
done
python3 -m memrec report $RES/standin-stacks-1.mrec 2>&1 | head -60 > $RES/standin-stacks.report.txt
python3 - $RES/standin-stacks-1.mrec <<'PY'
import sys
import numpy as np
from memrec.terms.events import Kind
from memrec.trace.reader import load_trace
t = load_trace(sys.argv[1])
print("stand-in trailer stacks:", t.trailer.get("stacks_read"))
ev = t.events[t.events["kind"] == int(Kind.ALLOC)]
print(f"{len(ev)} driver allocations, {int(np.count_nonzero(ev['stack']))} with a stack; the 5 largest:")
for e in ev[np.argsort(-ev["size"].astype(np.int64))][:5]:
    s = t.stack(int(e["stack"]))
    top = [f.label() for f in s if not f.native and "/torch/" not in f.file][:2] if isinstance(s, tuple) else [str(s)]
    print(f"  {int(e['size']) / 2**20:9.1f} MiB  {' <- '.join(top)}")
PY
date -u
} 2>&1 | tee $log
ls -la $RES
tar -czf $OUT/stack-truth.tgz -C $RES stack-truth.log stacks.report.txt standin-stacks.report.txt daemon.log stacks.mrec standin-stacks-1.mrec \
  daemon-standin-stacks-1.log standin-stacks-1.log p1/torch.json p2/torch.json 2>/dev/null
cp $log $OUT/
