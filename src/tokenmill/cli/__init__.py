"""The `tokenmill` command line: one module per command group (see main.py)."""
