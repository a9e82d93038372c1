"""The package version (also named by every trace's `hook_script` metadata)."""

__version__ = "0.2.0"
