"""Observers that run inside other inference engines and write SparSEEty's trace store."""
