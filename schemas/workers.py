"""What a worker publishes about itself in its heartbeat (`<p>:workers` hash field and
`<p>:worker:<name>` key, one JSON object each; docs/protocol.md, "Keys"), as a typed model.

Producers (`genpool status`, a client's no-worker check, the gateway's /v1/models) read these
documents, and any client can HSET that hash, so a document is untrusted input: readers parse
it with `parse_worker_info` and skip one that does not parse, with the reason, instead of
meeting a string where a count belongs. Strict types, as in schemas/routing.py: "3" is not 3.
Unknown fields are ignored (a newer worker may publish more), missing ones take their defaults
(an older worker published fewer).
"""
from __future__ import annotations

import json
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .request import describe_validation_error


def _count():
    return Field(0, ge=0)


class WorkerInfo(BaseModel):
    # no NaN or infinity (Python's json accepts them): a status line or a sum would show them
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    name: str = ""  # the workers hash field (readers set it from there)
    model: str = ""  # every model name it accepts, comma-joined (primary name and aliases)
    model_name: str = ""  # its primary name
    pid: int = _count()
    host: str = ""
    running: int = _count()  # jobs in flight
    state: str = "running"  # "running" | "draining" (a draining worker takes no new job)
    steps: int = _count()  # engine steps so far
    done: int = _count()
    failed: int = _count()
    reconnects: int = _count()  # times it reconnected to Redis
    lost: int = _count()  # jobs it lost to a reclaim
    refused: int = _count()  # jobs refused at intake
    busy_s: float = Field(0.0, ge=0)  # loop time with jobs in flight
    engine_s: float = Field(0.0, ge=0)  # time inside engine.step()
    stall_max_s: float = Field(0.0, ge=0)  # the longest step spent outside the engine
    # its router's counters (docs/protocol.md, "Prefix routing"); None: it published none
    routed_affinity: Optional[int] = Field(None, ge=0)
    routed_load: Optional[int] = Field(None, ge=0)
    routed_fallback: Optional[int] = Field(None, ge=0)
    handed_off: Optional[int] = Field(None, ge=0)
    handed_in: Optional[int] = Field(None, ge=0)
    backlog: Optional[int] = Field(None, ge=0)
    prefix_hit_rate: Optional[float] = Field(None, ge=0, le=1)
    prefix_routing: Optional[bool] = None
    started: float = 0.0  # unix time of its start
    beat: float = 0.0  # unix time of this document
    ttl_s: int = _count()  # its liveness key's TTL

    def served_names(self) -> set[str]:
        return {m for m in self.model.split(",") if m}

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    def serves(self, model: Optional[str]) -> bool:
        """Whether it would take a new job for `model` (None: any model)."""
        return not self.draining and (model is None or model in self.served_names())


def parse_worker_info(raw: Union[str, bytes, dict, None], name: Optional[str] = None
                      ) -> tuple[Optional[WorkerInfo], str]:
    """(the document, "") or (None, why it does not parse: one line naming the field). `name`:
    the workers hash field it was stored under, which wins over the document's own."""
    if raw is None:
        return None, "no worker document"
    try:
        if isinstance(raw, dict):  # the worker side, before it is sent (JSON types already)
            info = WorkerInfo.model_validate_json(json.dumps(raw))
        else:
            info = WorkerInfo.model_validate_json(raw)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            return None, "not a JSON document"
        if any(not err["loc"] for err in e.errors()):
            return None, "not a JSON object"
        return None, describe_validation_error(e)
    except (TypeError, ValueError) as e:  # a dict json.dumps cannot write
        return None, f"not a JSON document ({e})"
    if name is not None:
        info.name = name
    return info, ""
