"""Image references and registries: the OCI name grammar, the registry HTTP API, and the artifacts attached to an image (SBOM, smoke record, provenance, .sqsh)."""
