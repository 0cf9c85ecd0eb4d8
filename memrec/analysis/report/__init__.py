"""``memrec report``: the report's typed sections (:mod:`.model`), their builder (:mod:`.build`,
:mod:`.gpu`, :mod:`.tensors`, :mod:`.sites`), the answer every view leads with (:mod:`.answer`) and the text
(:mod:`.text`, :mod:`.tensors_text`, :mod:`.sites_text`)."""
