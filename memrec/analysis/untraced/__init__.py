"""NVML beside the traced bytes: the reconciliation per sample (:mod:`.reconcile`), the untraced
band split by family (:mod:`.split`) and compared between two runs (:mod:`.diff`)."""
