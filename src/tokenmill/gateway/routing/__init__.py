"""Routing policies: which replica of a pool takes a request."""
