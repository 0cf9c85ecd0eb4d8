"""A Python process that allocates through the stub driver from known lines, driven on stdin.

Runs under any CPython (pyenv's 3.9-3.13), so it imports nothing of memrec: ctypes only.
Commands (one per line; each answers one line): ``alloc SIZE`` (cuMemAlloc_v2 from
allocate() <- Holder.outer() <- main()), ``thread SIZE`` (the same on another thread),
``deep LEVELS SIZE`` (cuMemAlloc_v2 from allocate() <- LEVELS x (lambda <- map <- deep()) <- main()),
``tensor PTR SIZE`` (pytorch:malloc from make_block() <- main()), ``quit``.
Started with: python stack_worker.py LIBCUDA [LIBC10_CUDA]
"""

import ctypes
import sys
import threading


def allocate(lib, size):
    ptr = ctypes.c_uint64()
    return lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))  # LINE allocate


class Holder:
    def outer(self, lib, size):
        return allocate(lib, size)  # LINE Holder.outer


def deep(lib, levels, size):
    if levels:
        return list(map(lambda n: deep(lib, n, size), [levels - 1]))  # LINE deep (through C: a shim frame each)
    return allocate(lib, size)  # LINE deep.leaf


def make_block(torch, ptr, size):
    torch.stub_torch_malloc(ctypes.c_uint64(ptr), 0, ctypes.c_size_t(size), ctypes.c_uint64(0))  # LINE make_block


def main():
    lib = ctypes.CDLL(sys.argv[1])
    torch = ctypes.CDLL(sys.argv[2]) if len(sys.argv) > 2 else None
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        nums = [int(a, 0) for a in args]
        if cmd == "alloc":
            Holder().outer(lib, nums[0])  # LINE main.alloc
        elif cmd == "thread":
            worker = threading.Thread(target=Holder().outer, args=(lib, nums[0]))
            worker.start()
            worker.join()
        elif cmd == "deep":
            deep(lib, nums[0], nums[1])
        elif cmd == "tensor":
            make_block(torch, nums[0], nums[1])  # LINE main.tensor
        else:
            break
        print("done", flush=True)


if __name__ == "__main__":
    main()  # LINE module
