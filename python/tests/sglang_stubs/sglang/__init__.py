"""Stand-in of SGLang for kvstage tests (see ../README.md)."""
__version__ = "0.0.0+kvstage-stub"
