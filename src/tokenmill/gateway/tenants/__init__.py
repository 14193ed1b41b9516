"""Tenants by hashed API key, and their token-bucket rate limits."""
