"""Stand-in (tests only): see python/tests/vllm_stubs/README.md."""
