"""The agent's HTTP surface: /healthz, /readyz, /status and /metrics on FastAPI."""
