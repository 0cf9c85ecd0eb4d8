"""Workloads that make real CUDA driver calls (cuda-python, PyTorch), for selftest and validation.

Nothing here is imported by the recorder; these modules run as separate processes on GPU hosts.
"""
