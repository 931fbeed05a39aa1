"""chatapp.ttfa."""
