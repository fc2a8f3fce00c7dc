"""The block store: pages hashed, packed into segments, found through index files."""
