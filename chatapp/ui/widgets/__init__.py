"""Widgets of the chat TUI, one job each."""
