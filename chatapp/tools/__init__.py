"""chatapp.tools."""
