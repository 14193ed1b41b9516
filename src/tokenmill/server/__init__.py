"""Layer 4: the OpenAI-compatible HTTP server for one engine replica."""
