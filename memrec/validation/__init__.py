"""Validation code, not used by recording or reading: ``memrec selftest`` (selftest),
the trace-vs-truth cross-check (crosscheck), the GPU workloads of tests/gpu (gpu)
and the stub CUDA driver the BPF tests and ``memrec demo`` probe (stubdriver).
"""
