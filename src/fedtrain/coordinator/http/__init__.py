"""The coordinator's edge: the FastAPI app and its routes, the server that runs it, what one
client may hold (`limits`), the dashboard's files and the Prometheus text. Routes parse and
authorize, then call the service (`coordinator/service.py`). See docs/architecture.md."""
