"""memrec's version, in a leaf module: the trace writer, the daemon and the probe cache read it
without an edge to the package root (which sits above them all)."""

__version__ = "0.1.0"
