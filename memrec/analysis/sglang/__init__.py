"""SGLang from its markers: the KV budget (:mod:`.kv_budget`, compared in :mod:`.kv_budget_diff`),
the windows between the memory baseline and the KV sizing (:mod:`.windows`), the facts the
hooks report (:mod:`.facts`) and the report's SGLang section (:mod:`.section`, typed in
:mod:`.model`)."""
