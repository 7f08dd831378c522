"""The `bik` command line: bench, demo, check."""
