"""The recorder daemon: one event loop from the probes to the trace file and live subscribers."""
