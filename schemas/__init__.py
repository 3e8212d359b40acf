"""Wire models and Redis key names shared by producers and workers (pydantic + stdlib only)."""
from .events import (
                     TERMINAL,
                     Choice,
                     ErrorCode,
                     ErrorEvent,
                     Event,
                     EventAdapter,
                     FinishReason,
                     JobResult,
                     RestartEvent,
                     ResultEvent,
                     ResumeEvent,
                     RewindEvent,
                     Timings,
                     TokenEvent,
                     TrimmedEvent,
                     Usage,
                     parse_event,
)
from .keys import GROUP, LANES, PROTOCOL_VERSION, Keys, lane_for
from .request import (
                     MAX_PROMPT_CHARS,
                     SAMPLING_FIELDS,
                     ChatMessage,
                     JobRequest,
                     describe_validation_error,
                     new_job_id,
                     parse_request,
)

__all__ = [
    "TERMINAL", "Choice", "ErrorCode", "ErrorEvent", "Event", "EventAdapter", "FinishReason",
    "JobResult", "RestartEvent", "ResultEvent", "ResumeEvent", "RewindEvent", "Timings", "TokenEvent", "TrimmedEvent", "Usage",
    "parse_event",
    "GROUP", "LANES", "PROTOCOL_VERSION", "Keys", "lane_for", "MAX_PROMPT_CHARS", "SAMPLING_FIELDS",
    "ChatMessage", "JobRequest", "describe_validation_error", "new_job_id", "parse_request",
]
