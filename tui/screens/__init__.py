"""Screens of the memrec TUI (help)."""
