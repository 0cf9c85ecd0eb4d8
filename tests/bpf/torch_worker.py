"""A process using the stub driver and the stub libc10_cuda.so, driven line by line on stdin.

Commands (one per line; each answers one JSON line on stdout):
    sem                       -> [malloc semaphore, free semaphore] as this process sees them
    segment SIZE              -> cuMemAlloc_v2 of SIZE bytes on the current device: its pointer
    oom                       -> a cuMemAlloc_v2 larger than the stub device (fails): the result
    malloc PTR DEVICE SIZE STREAM -> pytorch:malloc fired (if enabled) with these arguments
    free PTR / free2 PTR      -> pytorch:free at the first / second site
    loop BASE N SIZE          -> N x (malloc BASE+i*SIZE, free) alternating the two free sites
    quit
Started with: python torch_worker.py LIBCUDA LIBC10_CUDA
"""

from __future__ import annotations

import ctypes
import json
import sys

from memrec.validation.stubdriver.driver import Driver
from memrec.validation.stubdriver.driver import Facts


def main() -> None:
    drv = Driver(sys.argv[1], Facts())
    drv.init()
    drv.use_device(0)
    torch = ctypes.CDLL(sys.argv[2])
    torch.stub_torch_malloc.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64]
    torch.stub_torch_free.argtypes = [ctypes.c_uint64]
    torch.stub_torch_free_other.argtypes = [ctypes.c_uint64]
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        nums = [int(a, 0) for a in args]
        if cmd == "sem":
            out = [torch.stub_semaphore(0), torch.stub_semaphore(1)]
        elif cmd == "segment":
            out = drv.alloc(nums[0])
        elif cmd == "oom":
            out = drv.alloc(1 << 50, expect=2)
        elif cmd == "malloc":
            torch.stub_torch_malloc(*nums)
            out = None
        elif cmd in ("free", "free2"):
            (torch.stub_torch_free if cmd == "free" else torch.stub_torch_free_other)(nums[0])
            out = None
        elif cmd == "loop":
            base, n, size = nums
            for i in range(n):
                torch.stub_torch_malloc(base + i * size, 0, size, 0)
                (torch.stub_torch_free if i % 2 else torch.stub_torch_free_other)(base + i * size)
            out = n
        else:
            break
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
