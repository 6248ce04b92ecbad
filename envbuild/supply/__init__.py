"""The supply chain: the publish job, provenance, SBOM, the vulnerability gate, verify, and the generated CI that publishes the matrix."""
