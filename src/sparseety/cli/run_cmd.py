"""``sparseety run`` (placeholder until the engine lands)."""
