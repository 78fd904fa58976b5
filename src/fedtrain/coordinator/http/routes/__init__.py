"""The coordinator's HTTP routes, one `APIRouter` a module, each area in its own file.

More: docs/architecture.md, "coordinator/http/routes/__init__.py".
"""
