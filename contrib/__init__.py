"""Files for operators, shipped in the wheel as ``memrec.contrib`` package data: the systemd unit
and its sysusers.d group (``systemd/``), the Grafana dashboard (``grafana/``)."""
