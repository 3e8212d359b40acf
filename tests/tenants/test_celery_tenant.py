"""Issue 31: the Celery task carries a job's tenant (run in-process with apply(), against a real
Redis and an in-process worker on the fake engine)."""
from __future__ import annotations

from genpool.schemas import Keys
from genpool.schemas.connection import connect
from tests.fake_engine import FakeEngine
from tests.pool_helpers import drop_prefix, new_prefix, worker_thread


def test_the_generate_task_submits_as_the_tenant_it_names(redis_url):
    from genpool.workers.integrations import celery_app

    prefix = new_prefix("cel")
    celery_app.configure(redis_url, prefix)
    r = connect(redis_url, decode_responses=True)
    try:
        with worker_thread(FakeEngine(), redis_url, prefix):
            out = celery_app.generate.apply(args=("hello",), kwargs={
                "tenant": "acme", "max_tokens": 2, "job_id": "cel-1"}).get(timeout=60)
        assert out["error"] is None and out["job_id"] == "cel-1"
        assert r.hget(Keys(prefix).job("cel-1"), "tenant") == "acme"
    finally:
        celery_app.configure(redis_url, None)
        r.close()
        drop_prefix(redis_url, prefix)
