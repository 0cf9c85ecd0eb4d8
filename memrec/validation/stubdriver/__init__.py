"""A stub libcuda.so.1 with the CUDA driver's ABI, its builder and workloads: real uprobes without a GPU (tests, memrec demo)."""
