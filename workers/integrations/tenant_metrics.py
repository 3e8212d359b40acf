"""Per-tenant Prometheus counters (issue 31) with a bounded label set.

A tenant name comes from the job (any caller may pick one through Client(tenant=...)), so it
cannot be a label as it is: MAX_TENANT_LABELS tenants get their own label and every other one
counts under "other". The labels go first to the top tenants by the last day's usage when the
worker starts (seed(), from the usage hashes), then to tenants as the worker first sees them
while places are left. Counters cannot move between labels, so the set is fixed once full;
`genpool usage` has every tenant's exact figures.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

NS = "genpool:"
MAX_TENANT_LABELS = 20
OTHER = "other"


class TenantCounters:
    def __init__(self, model_name: str, registry: CollectorRegistry,
                 max_labels: int = MAX_TENANT_LABELS):
        self.model, self.max_labels = model_name, max_labels
        self.named: set[str] = set()
        lab = ["model_name", "tenant"]
        self.jobs = Counter(NS + "tenant_request_success", "Jobs finished with a result, per "
                            "tenant", lab, registry=registry)
        self.prompt = Counter(NS + "tenant_prompt_tokens", "Prompt tokens of finished jobs, per "
                              "tenant", lab, registry=registry)
        self.generated = Counter(NS + "tenant_generation_tokens", "Generated tokens of finished "
                                 "jobs, per tenant", lab, registry=registry)

    def seed(self, ranked: list[str]) -> None:
        """Give labels to these tenants first (the top ones by usage, in order)."""
        for tenant in ranked:
            if len(self.named) >= self.max_labels:
                return
            if tenant != OTHER:
                self.named.add(tenant)

    def label(self, tenant: str) -> str:
        if tenant in self.named or (tenant != OTHER and len(self.named) < self.max_labels):
            self.named.add(tenant)
            return tenant
        return OTHER

    def finished(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        t = self.label(tenant)
        self.jobs.labels(self.model, t).inc()
        self.prompt.labels(self.model, t).inc(prompt_tokens)
        self.generated.labels(self.model, t).inc(completion_tokens)
