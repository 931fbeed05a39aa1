"""chatapp: a terminal tool for watching a small language model think while it talks."""

__version__ = "0.1.0"
