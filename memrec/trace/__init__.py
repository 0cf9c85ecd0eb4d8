"""Trace format v1: writer, reader and the in-memory model (spec: docs/format.md)."""
