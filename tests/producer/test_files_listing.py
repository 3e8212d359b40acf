"""Paging through files while deleting them, as the official client's auto-pagination does:
`for f in client.files.list(): client.files.delete(f.id)` asks for the next page after the id it
just deleted. That cursor named nothing any more, and the listing ended there: every file past
the first page was left. A real uvicorn server (the gateway's config), real Redis, `openai`."""
from __future__ import annotations

import io

import openai

from tests.pool_helpers import drop_prefix, new_prefix
from tests.producer.test_gateway_limits import serve

LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        b'"body": {"model": "m", "prompt": "p"}}\n')


def test_deleting_while_paging_reaches_every_file(redis_url):
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwfilelist")
    app = create_app(redis_url, prefix)
    try:
        with serve(app) as port:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            ids = [c.files.create(file=(f"f{i}.jsonl", io.BytesIO(LINE)), purpose="batch").id
                   for i in range(7)]
            first = c.files.list(limit=2)
            assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
            for f in first.data:
                c.files.delete(f.id)
            after = c.files.list(limit=2, after=first.data[-1].id)  # a deleted cursor
            assert [f.id for f in after.data] == ids[::-1][2:4] and after.has_more
            remaining = [f.id for f in c.files.list(limit=2)]  # auto-pagination: every page
            assert remaining == ids[::-1][2:]
            for f in c.files.list(limit=2):  # deleting as it goes
                c.files.delete(f.id)
            assert c.files.list().data == []
            assert not [fid for fid in ids if _exists(c, fid)]
    finally:
        drop_prefix(redis_url, prefix)


def _exists(c: openai.OpenAI, fid: str) -> bool:
    try:
        c.files.retrieve(fid)
        return True
    except openai.NotFoundError:
        return False
