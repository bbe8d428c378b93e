"""``sparseety extract`` (placeholder until the extractor lands)."""
