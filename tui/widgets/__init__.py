"""Widgets of the memrec TUI (graph, panels)."""
