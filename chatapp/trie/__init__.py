"""chatapp.trie."""
