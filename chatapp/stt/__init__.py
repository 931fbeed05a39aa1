"""chatapp.stt."""
