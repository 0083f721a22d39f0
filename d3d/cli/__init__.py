"""The `d3d` command line."""
