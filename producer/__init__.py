"""Producers: submit jobs to a genpool deployment and read their tokens (needs redis + pydantic)."""
from genpool.schemas import JobResult, RestartEvent, TokenEvent
from genpool.schemas.config import key_prefix, redis_url

from .aio import AsyncClient, AsyncJob
from .client import Client, Job
from .errors import JobFailed, NoWorkers, QueueUnavailable
from .queued_cap import QueueCapReached
from .quotas import RateLimited

__all__ = ["AsyncClient", "AsyncJob", "Client", "Job", "JobFailed", "JobResult", "NoWorkers",
           "QueueCapReached", "QueueUnavailable", "RateLimited", "RestartEvent", "TokenEvent", "key_prefix", "redis_url"]
