"""Model implementations and the model registry (names -> checkpoint directories)."""
