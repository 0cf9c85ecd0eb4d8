"""Everything that touches the kernel or the driver: the BPF program and its loader, library discovery, /proc reading and NVML (the only package that imports bcc or pynvml)."""
