"""chatapp.models."""
