"""Replicas, the pools that group them, their circuit breakers and health checks."""
