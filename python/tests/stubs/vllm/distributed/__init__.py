"""Stand-in (tests only): see python/tests/stubs/README.md."""
