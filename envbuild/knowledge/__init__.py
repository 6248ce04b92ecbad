"""What envbuild knows, as data with its rules: the compatibility matrix, the rules over it, the request a user makes and its validation, and the hash locks (Python and OS)."""
