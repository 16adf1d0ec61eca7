"""Memories of the agent replay (:mod:`~contextkit.workloads.replay`): templates, slots, facts.

Each topic has a handful of episode/decision templates filled from a seeded slot
draw (:func:`memory_slots`); general memories fit several topics. The replay turns
them into :class:`ReplayMemory` records, a scripted ranking or a seeded memory graph.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from contextkit.workloads.replay_content import CUSTOMER_FACING, PEOPLE, random_date

# ---------------------------------------------------------------------------- memories

@dataclass(frozen=True)
class ReplayMemory:
    key: str  # stable id suffix: "<topic>-<j>" or "general-<j>"
    text: str
    kind: str  # "episodic" | "semantic"
    topics: tuple[str, ...]  # its own topic first; general memories list the topics they fit
    importance: float
    date: str  # YYYY-MM-DD, used as created_at in a memory graph
    general: bool


MEMORY_TEMPLATES: dict[str, tuple[tuple[str, str], ...]] = {
    "latency": (
        ("episodic", "{date} postmortem {inc} ({sev}): {svc} p95 rose from {ms_lo} ms to "
                     "{ms_hi} ms for {minutes} min; {latency_cause}."),
        ("semantic", "{date} decision after {inc}: {latency_decision}."),
        ("episodic", "{date}: while debugging slow {svc}, {latency_finding}; the fix took "
                     "{minutes} min once found."),
        ("semantic", "{date}: {person} {latency_pref}."),
    ),
    "deploy": (
        ("episodic", "{date}: {svc} {ver_new} went to canary at {clock} CET and was promoted "
                     "after 15 min; {deploy_note}."),
        ("episodic", "{date}: {svc} {ver_new} shipped a config change that {config_effect}; the "
                     "canary caught it and it was rolled back within {minutes} min."),
        ("semantic", "{date} decision after {inc}: {deploy_decision}."),
        ("semantic", "{date}: {svc} deploys cluster between 14:00 and 17:00 CET; releases in "
                     "that window preceded {count} of the last {count_of} incidents."),
    ),
    "rollback": (
        ("episodic", "{date}: rollback of {svc} from {ver_new} to {ver_old} took {minutes} min; "
                     "{rollback_note}."),
        ("semantic", "{date} lesson from {inc}: {rollback_lesson}."),
        ("semantic", "{date} decision after {inc}: {rollback_decision}, as {person} asked."),
    ),
    "incident": (
        ("semantic", "{date}: {person} reviewed the {inc} summary and asked for "
                     "{incident_feedback}."),
        ("episodic", "{date}: follow-up '{followup}' from {inc} is {followup_status}, owner "
                     "{person}."),
        ("episodic", "{date}: the {inc} summary estimated {orders} failed checkouts and EUR "
                     "{eur} lost over {minutes} min; finance later confirmed it within 10%."),
        ("semantic", "{date}: {person} {incident_pref}."),
    ),
    "cost": (
        ("episodic", "{date}: AWS spend rose {pct}% week over week because of {cost_cause}; "
                     "{cost_result}."),
        ("semantic", "{date}: FinOps asked {cost_question}; {svc} was the top driver then."),
        ("semantic", "{date} decision: {cost_decision}, saving about EUR {eur_month} per month; "
                     "approved by {person}."),
    ),
    "capacity": (
        ("episodic", "{date}: during the {sale_event}, traffic peaked at {mult}x normal; {svc} "
                     "ran {replicas} replicas and payments-db CPU reached {pct}%."),
        ("semantic", "{date} capacity decision: keep {svc} at a minimum of {replicas} replicas "
                     "during sales, HPA target CPU {hpa_pct}%, reviewed by {person}."),
        ("episodic", "{date}: a pre-sale load test at {mult}x found {capacity_finding} as the "
                     "first limit."),
        ("semantic", "{date}: {person} said {capacity_pref}."),
    ),
}

# choices may use the basic slots of memory_slots ({svc}, {ver_new}, {slo_ms}, ...)
SLOT_CHOICES: dict[str, tuple[str, ...]] = {
    "latency_cause": (
        "root cause: payments-db pool exhausted by a reporting query, fixed by moving reports "
        "to the replica",
        "root cause: a missing index on orders.customer_id after a migration, fixed by "
        "creating it concurrently",
        "root cause: redis-sessions evictions after maxmemory was lowered, fixed by restoring "
        "6 GiB",
        "root cause: CPU throttling after limits were cut to 500m, fixed by raising them to "
        "1500m",
        "root cause: N+1 queries in the recommendations widget, fixed by batching lookups",
        "root cause: an uncached pricing-service call added in a release, fixed by a 30 s "
        "in-process cache",
    ),
    "latency_decision": (
        "latency alerts for {svc} fire on p95 above {slo_ms} ms for 10 min, never on averages",
        "every caller of pricing-service caches its responses for at least 30 s",
        "trace sampling for {svc} went up to 20% so slow requests always have a trace",
        "payments-db alerts at 80% of max_connections",
        "{svc} got a per-dependency timeout budget of {slo_ms} ms",
    ),
    "latency_finding": (
        "traces showed 70% of the time in one pricing-service call per cart line",
        "the slow query log showed sequential scans on order_items",
        "p95 was high in one availability zone only, pointing at a bad node",
        "GC pauses above 400 ms lined up with the latency spikes",
        "the HPA sat at max replicas and new pods waited 3 min for nodes",
    ),
    "latency_pref": (
        "asked that latency investigations show p95 and p99 next to deploy markers, because "
        "averages hid a {svc} regression",
        "prefers a latency heatmap over a p95 line when {svc} latency is bimodal",
        "wants the slowest trace id quoted in every latency update",
        "asked Atlas to compare latency with the same hour a week earlier, not yesterday",
    ),
    "deploy_note": (
        "error rate stayed at baseline but p95 rose 12%, which the canary check ignored",
        "no issues and the promotion was automatic",
        "the canary ran on one pod after the HPA scaled down, so the signal was weak",
        "a feature flag hid the new code path, so the canary never exercised it",
    ),
    "config_effect": (
        "halved the HTTP client timeout to 500 ms",
        "pointed the pricing client at the staging endpoint",
        "disabled response caching for the product catalog",
        "raised the log level to debug and doubled log volume",
    ),
    "deploy_decision": (
        "deploy tickets for {svc} include the diff_release summary (config, new downstream "
        "calls, migrations)",
        "canary analysis compares p95 as well as the error rate",
        "no {svc} deploys after 16:00 CET on Fridays",
        "config changes ship as their own release, never bundled with code",
        "a canary counts only with at least 2 pods and 5% of real traffic",
    ),
    "rollback_note": (
        "the HPA scaled down mid-rollout and we scaled back to 8 replicas by hand",
        "cache warm-up kept p95 elevated for about 5 minutes afterwards",
        "it went cleanly and the error rate was at baseline within 3 minutes",
        "one pod looped in CrashLoopBackOff on a stale ConfigMap until it was deleted",
    ),
    "rollback_lesson": (
        "check diff_release for migrations before rolling back {svc}; {ver_new} depended on a "
        "new column",
        "roll back one cluster at a time; doing prod-eu and prod-us together doubled the "
        "cold-cache hit",
        "pin the HPA minimum before rolling back {svc}, or it scales down while old pods start",
        "announce a rollback in #platform-incidents first; two people rolled back {svc} at once",
        "turning the flag off would have been faster than rolling back {svc}",
    ),
    "rollback_decision": (
        "SEV2 rollbacks are pre-approved, but Atlas confirms version and cluster with the "
        "on-call engineer first",
        "every rollback gets a ticket and a timeline entry within 10 minutes",
        "a rolled-back release stays blocked in CI until its fix is reviewed",
        "payments-gateway rollbacks need Aisha Okafor's approval, even during an incident",
    ),
    "incident_feedback": (
        "customer impact as failed checkouts and EUR, not only error percentages",
        "five summary lines before the timeline",
        "the detection gap, alert time minus start time, as its own line",
        "due dates on every follow-up instead of 'soon'",
    ),
    "incident_pref": (
        "wants SEV2 timelines as bullets in CET with UTC in brackets",
        "posts SEV2 summaries to #platform-incidents and the Monday ops review",
        "wants the status page text drafted together with the incident summary",
        "asks for a one-line 'what we changed' before the root cause",
    ),
    "followup": (
        "add p95 to the canary analysis", "cache pricing lookups in checkout-api",
        "alert on payments-db connections above 80%", "runbook for rollbacks with migrations",
        "load test before every sale",
    ),
    "followup_status": ("done", "in progress", "two weeks overdue", "not started"),
    "cost_cause": (
        "NAT gateway traffic from image-resizer reading S3 across zones",
        "an orphaned EBS snapshot schedule",
        "search-api left at 3x replicas after a load test",
        "debug logging in orders-worker flooding CloudWatch",
        "gp2 volumes not yet migrated to gp3",
    ),
    "cost_result": (
        "an S3 gateway endpoint removed most of it", "it was fixed the same day",
        "it was reverted after two days", "it is still an open FinOps ticket",
    ),
    "cost_question": (
        "for cost answers in EUR per day and per service, top three drivers first",
        "why {svc} cost grew faster than its traffic",
        "for a monthly forecast next to every cost change",
        "which costs scale with orders and which are fixed",
    ),
    "cost_decision": (
        "dev and staging scale to zero outside 07:00-20:00 CET",
        "all gp2 volumes move to gp3",
        "CloudWatch log retention drops to 14 days",
        "batch-eu runs on spot instances",
        "every VPC gets an S3 gateway endpoint",
    ),
    "sale_event": ("Black Friday sale", "spring clearance sale", "winter collection launch",
                   "TV campaign week"),
    "capacity_finding": (
        "payments-db connections at 380 of 400",
        "checkout-api pods taking 2 min to become ready",
        "the node group reaching its max of 24 nodes",
        "redis-sessions memory at 85%",
    ),
    "capacity_pref": (
        "capacity forecasts need a 30% headroom line and the monthly EUR delta per option",
        "forecasts must include payments-db connections, not only CPU",
        "sale readiness needs a load test within 14 days of the sale",
        "checkout-api should be pre-scaled an hour before a sale instead of trusting the HPA",
    ),
    "sev": ("SEV2", "SEV2", "SEV3", "SEV1"),
}

GENERAL_MEMORIES: tuple[tuple[str, str, tuple[str, ...], float, str], ...] = (
    ("Jonas Weber is a senior SRE; he wants the exact command shown before Atlas runs it and "
     "dislikes long preambles.", "semantic", ("rollback", "latency"), 0.95, "2024-06-03"),
    ("Jonas prefers kubectl results as a short table with only the unhealthy rows.",
     "semantic", ("latency", "deploy"), 0.8, "2024-07-15"),
    ("Priya Raman must hear about any SEV2 within 15 minutes, in #platform-incidents rather "
     "than by DM.", "semantic", ("incident", "latency"), 0.9, "2024-05-21"),
    ("checkout-api belongs to Marco Silva's checkout team; pricing-service moved to them in "
     "January 2025.", "semantic", ("deploy", "latency"), 0.85, "2025-01-13"),
    ("payments-db is Postgres 15 on RDS db.r6g.2xlarge with one read replica and "
     "max_connections 400.", "semantic", ("latency", "capacity"), 0.8, "2024-04-02"),
    ("2024-10-14: Atlas paged the secondary on-call for a SEV3 by mistake; since then it states "
     "the severity rule it applied before paging.", "episodic", ("incident",), 0.75,
     "2024-10-14"),
    ("Tom Becker takes over primary on-call at 18:00 CET this week and likes handoff notes "
     "with open tickets first.", "semantic", ("incident", "capacity"), 0.7, "2025-03-10"),
    ("2025-02-20: after INC-1987 a runbook for the checkout latency alert was written; it "
     "starts with traces, then pricing-service, then payments-db.", "episodic",
     ("latency", "rollback"), 0.85, "2025-02-20"),
    ("Marco Silva prefers a tag in the incident channel to a page for checkout regressions "
     "during business hours.", "semantic", ("deploy", "incident"), 0.6, "2024-11-05"),
    ("Lena Fischer (FinOps) reviews the AWS bill every Monday and asks platform about any "
     "service whose cost grew more than 10%.", "semantic", ("cost",), 0.8, "2024-09-09"),
    ("The spring sale starts on 2025-03-20; a change freeze applies from 48 hours before "
     "it.", "semantic", ("capacity", "deploy"), 0.75, "2025-02-27"),
    ("Useful dashboards: Checkout overview, Payments DB, Kafka lag, Cluster capacity and AWS "
     "cost daily.", "semantic", ("latency", "cost"), 0.45, "2024-03-18"),
)


def memory_slots(rng: random.Random) -> dict[str, str]:
    """Every slot any memory template uses, drawn in one fixed order."""
    minor = rng.randrange(6, 14)
    count_of = rng.randrange(4, 9)
    slots = dict(
        date=random_date(rng),
        inc=f"INC-{rng.randrange(1500, 2035)}",
        svc=rng.choice(CUSTOMER_FACING),
        person=rng.choice(PEOPLE),
        minutes=str(rng.randrange(9, 96)),
        ms_lo=str(rng.randrange(140, 270)),
        ms_hi=str(rng.randrange(650, 2400)),
        slo_ms=str(rng.choice((250, 300, 400, 500))),
        ver_new=f"v2.{minor}.{rng.randrange(0, 4)}",
        ver_old=f"v2.{minor - 1}.{rng.randrange(0, 6)}",
        clock=f"{rng.randrange(9, 18):02d}:{rng.randrange(0, 60):02d}",
        count_of=str(count_of),
        count=str(rng.randrange(2, count_of + 1)),
        orders=f"{rng.randrange(120, 2600):,}",
        eur=f"{rng.randrange(4, 120) * 500:,}",
        eur_month=f"{rng.randrange(6, 40) * 100:,}",
        pct=str(rng.randrange(11, 48)),
        mult=f"{rng.randrange(20, 45) / 10:.1f}",
        replicas=str(rng.randrange(8, 25)),
        hpa_pct=str(rng.choice((55, 60, 65, 70))),
    )
    basic = dict(slots)
    for name, values in SLOT_CHOICES.items():
        slots[name] = rng.choice(values).format(**basic)
    return slots
