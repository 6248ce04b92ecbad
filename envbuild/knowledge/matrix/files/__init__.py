"""The models of the matrix files, one module per YAML file."""
