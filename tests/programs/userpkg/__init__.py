"""A user's package, importable from its parent folder only (the launch's working directory)."""
