"""jaxpaged's OpenAI-compatible HTTP server (FastAPI + uvicorn); `python -m server`."""
