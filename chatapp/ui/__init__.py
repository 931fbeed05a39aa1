"""chatapp.ui."""
