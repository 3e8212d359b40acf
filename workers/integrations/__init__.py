"""What the worker plugs into, each optional and outside the loop: Celery (celery_app,
celery_worker), Flower's events (flower_events), Prometheus (metrics), embedded Redis (embedded)."""
