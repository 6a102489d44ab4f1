"""OpenAI-compatible HTTP server on the engine (`mlakit serve`) and its load generator (`mlakit bench-serve`).

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client, aiohttp); `import mlakit` never imports it.
"""
