"""The short Celery app path: `celery -A genpool.workers.celery worker|flower ...` is
`celery -A genpool.workers.integrations.celery_app ...` (the app and its `genpool.generate` task)."""
from genpool.workers.integrations.celery_app import app, generate  # noqa: F401

__all__ = ["app", "generate"]
