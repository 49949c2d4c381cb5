"""The OpenAI-compatible server (needs the `server` extra: fastapi, uvicorn, prometheus_client)."""
