"""chatapp.engine."""
