"""Layer 3: one OpenAI-compatible front door for a fleet of replicas (`tokenmill gateway`).

A request goes: tenant (API key) -> rate limits -> model or tier -> priority class and
degradation -> allowed regions -> pools in preference order -> a replica chosen by the pool's
policy -> upstream, retried once elsewhere if it fails before its first byte. Never imports
the engine; backends are `tokenmill serve` replicas or any OpenAI-compatible server.
"""
