"""The OpenAI-compatible server (``attnzoo serve``); needs the ``serve`` extra (fastapi, uvicorn, prometheus_client)."""
