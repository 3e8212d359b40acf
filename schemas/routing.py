"""What a worker publishes about itself for prefix-aware routing (`<p>:route:{<p>}:load`, one
JSON object per worker name; docs/protocol.md, "Prefix routing"), as a typed model.

Peers read each other's entries to decide where a job runs, so an entry is untrusted input: any
client can HSET that hash. Readers parse it with `PeerLoad` and leave a peer whose entry does not
parse out of routing (workers/prefix_index.py), rather than meeting a string where a count
belongs in the middle of a routing decision. Strict types, as in schemas/request.py: "3" is not 3.
"""
from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .request import describe_validation_error


class PeerLoad(BaseModel):
    # Unknown fields are ignored (a newer worker may publish more); no NaN or infinity, which
    # Python's json accepts and which would poison every cost comparison.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    free: int = Field(0, ge=0)  # jobs it can start now
    backlog: int = Field(0, ge=0)  # jobs handed to it, not started yet
    slots: int = Field(1, ge=1)  # jobs it runs at once
    job_tokens: float = Field(0.0, ge=0)  # prompt tokens it computed per job, recently
    block_size: Optional[int] = Field(None, ge=1)  # its KV block size (None: incompatible)
    model: Optional[str] = None  # its served model names, comma-joined (None: incompatible)
    at: float = 0.0  # unix time of the publish


def parse_peer_load(raw: Union[str, bytes, None]) -> tuple[Optional[PeerLoad], str]:
    """(the entry, "") or (None, why it does not parse: one line naming the field)."""
    if raw is None:
        return None, "no load entry"
    try:
        return PeerLoad.model_validate_json(raw), ""
    except ValidationError as e:
        return None, describe_validation_error(e)
