"""Audits of what a server reports against what the model itself says."""
