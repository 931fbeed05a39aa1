"""Modal screens of the chat TUI: settings, program, history, help."""
