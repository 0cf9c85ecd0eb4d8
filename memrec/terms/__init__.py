"""The shared vocabulary every layer speaks: event kinds and APIs (events), the event
columns (columns), byte units (units), rank labels (ranks), the daemon's socket
protocol (protocol) and CUDA's result names (cu_results). Nothing here imports
another layer of memrec.
"""
