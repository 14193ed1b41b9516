"""Exact-match response cache for deterministic requests (memory or Redis)."""
