"""Per-tenant Prometheus counters (issue 31) with a bounded label set.

A tenant name comes from the job (any caller may pick one through Client(tenant=...)), so it
cannot be a label as it is: the first MAX_TENANT_LABELS tenants a worker sees get their own
label, and every later one counts under "other". Counters cannot move between labels, so the
set is fixed once full; `genpool usage` has every tenant's exact figures.
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
