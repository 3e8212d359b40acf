"""Producers: submit jobs to a genpool deployment and read their tokens (needs redis + pydantic)."""
from schemas import JobResult, RestartEvent, TokenEvent

from .aio import AsyncClient, AsyncJob
from .client import Client, Job
from .config import key_prefix, redis_url

__all__ = ["AsyncClient", "AsyncJob", "Client", "Job", "JobResult", "RestartEvent", "TokenEvent",
           "key_prefix", "redis_url"]
