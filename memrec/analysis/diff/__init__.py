"""``memrec diff``: two runs compared by rank, phase and GPU (:mod:`.build`, typed in
:mod:`.model`), by allocation site (:mod:`.sites`), whether they are one workload (:mod:`.related`), and the text (:mod:`.text`)."""
