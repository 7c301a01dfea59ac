"""OpenAI-compatible HTTP server on aiohttp."""
