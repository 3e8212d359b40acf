"""One batch input line -> one job request, and one finished line -> one line of the batch's
output or error file, in OpenAI's line format (producer/batch_driver.py).

A line that ran gets `response` (status_code, request_id, body): 200 and the completion in the
output file, an error status and OpenAI's error body in the error file. A line that never ran
(the batch was cancelled or expired first) gets `error` {code, message} in the error file.
"""
from __future__ import annotations

import json
from typing import Optional

from genpool.schemas import JobResult
from genpool.schemas.batches import BATCH_PRIORITY, BatchRecord
from genpool.schemas.workers import WorkerInfo

from .jsonl import job_id_for
from .liveness import serving
from .openai_format import ENDPOINTS, APIError, OpenAIRequest, error_from_event, parse_body
from .openai_response import completion_body

UNRUN_MESSAGE = {
    "batch_cancelled": "The batch was cancelled before this request finished.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}
# A job error that the batch's own end caused: reported as the batch's code, not the worker's.
JOB_ERROR_CODE = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def ident(batch_id: str) -> str:
    """The namespace of a batch's job ids (producer/batch.py job_id_for)."""
    return batch_id.removeprefix("batch_")


def line_job_id(batch_id: str, custom_id: str) -> str:
    return job_id_for(ident(batch_id), custom_id)


def to_request(obj: dict, rec: BatchRecord, live: Optional[list[WorkerInfo]] = None
               ) -> OpenAIRequest:
    """The job of one input line (structurally checked at upload); APIError when its body cannot
    run here. `live`: the live workers, when known, to refuse a model none of them serves."""
    if obj["url"] != rec.endpoint:
        raise APIError(400, f"url {obj['url']} is not this batch's endpoint {rec.endpoint}",
                       param="url", code="invalid_value")
    body = obj["body"]
    if body.get("stream"):
        raise APIError(400, "stream is not supported in a batch", param="body.stream",
                       code="invalid_value")
    req = parse_line_body(obj, rec)
    model = req.kwargs.get("model")
    if rec.models and model not in rec.models:
        raise APIError(404, f"The model '{model or '(none named)'}' does not exist or this "
                            f"batch's key may not use it", param="model", code="model_not_found")
    if live and model and not serving(live, model):
        raise APIError(404, f"The model '{model}' does not exist in this pool", param="model",
                       code="model_not_found")
    return req


def parse_line_body(obj: dict, rec: BatchRecord) -> OpenAIRequest:
    req = parse_body(ENDPOINTS[rec.endpoint], obj["body"], priority=BATCH_PRIORITY,
                     default_model=rec.model, job_id=line_job_id(rec.id, obj["custom_id"]))
    # every line runs in the bulk lane, whatever priority its body asks for (a batch must not
    # jump ahead of interactive traffic), and ends with the batch's window
    req.kwargs["priority"] = max(rec.priority_ceiling,
                                 req.kwargs.get("priority", rec.priority_ceiling))
    req.kwargs["deadline"] = float(rec.expires_at)
    req.kwargs["tenant"] = rec.owner  # the batch's tenant's job (schemas/request.py)
    return req


def success(job_id: str, custom_id: str, req: OpenAIRequest, res: JobResult) -> dict:
    return {"id": f"batch_req_{job_id}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id,
                         "body": completion_body(req, res)}, "error": None}


def http_error(job_id: str, custom_id: str, err: APIError) -> dict:
    return {"id": f"batch_req_{job_id}", "custom_id": custom_id,
            "response": {"status_code": err.status, "request_id": job_id, "body": err.body()},
            "error": None}


def unrun(job_id: str, custom_id: str, code: str) -> dict:
    return {"id": f"batch_req_{job_id}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": UNRUN_MESSAGE[code]}}


def finished(job_id: str, obj: dict, rec: BatchRecord, res: JobResult) -> tuple[bool, dict]:
    """(ok, file line) of a line whose job ended."""
    cid = obj["custom_id"]
    if res.error is None:
        return True, success(job_id, cid, parse_line_body(obj, rec), res)
    if res.error.code in JOB_ERROR_CODE:
        return False, unrun(job_id, cid, JOB_ERROR_CODE[res.error.code])
    return False, http_error(job_id, cid, error_from_event(res.error))


def stored(lineno: int, ok: bool, line: dict) -> str:
    """What the batch's done hash keeps per custom_id: the file line and where it goes."""
    return json.dumps({"n": lineno, "ok": ok, "line": line}, ensure_ascii=False)
