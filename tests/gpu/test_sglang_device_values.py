"""The SGLang hooks' device numbers with real torch on a real GPU: ordinal, UUID, free memory."""

from __future__ import annotations


def test_device_values_match_nvml(torch):
    # GIVEN torch with CUDA initialised on device 0
    from memrec.probes.nvml import list_gpus
    from memrec.sglang_hooks.device import device_values

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    # WHEN the hooks read the current device's numbers
    out: dict = {}
    ordinal = device_values(out)
    # THEN they name device 0 with NVML's UUID, and local free/total memory
    gpus = list_gpus()
    print(out, [g.uuid for g in gpus])
    assert ordinal == 0
    assert out["gpu_uuid"] == gpus[0].uuid
    assert out["total_bytes"] == torch.cuda.mem_get_info()[1]
    assert 0 < out["free_bytes"] <= out["total_bytes"]
