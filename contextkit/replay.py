"""A deterministic agent replay workload: a 10-layer SRE assistant and a 20-turn session.

Shared by the demo and the TTFT benchmark. The agent is *Atlas*, the SRE/DevOps
assistant of a small online retailer's platform team, helping the on-call engineer
through a checkout latency incident (investigate, find the deploy, roll back, write
the summary), then a cost question and sale capacity planning.

Per turn, ``current_time`` and ``system_state`` change (the platform snapshot is
regenerated from a seeded RNG, the turn index and the incident's phase), and
``memories`` change when the topic of the user message changes (about every 3-5
turns). ``axioms``, ``identity``, ``system_knowledge``, ``capabilities``,
``neurons``, ``affect`` and ``awareness`` stay byte-identical for the whole session.

At ``scale=1`` every layer holds 80-95% of its default token budget (SmolLM2
tokenizer), about 6K tokens in all. ``scale`` grows the layers that have expanded
budgets (``system_state``, ``neurons``, ``memories``, ``awareness``) so that the
whole prompt is about ``scale`` times the ``scale=1`` prompt, each layer growing in
proportion to its expanded-budget headroom (``scale=5``: about 30K tokens, every
expandable layer 1.6-1.8x over its expanded budget, for ``synthesize_for_budget`` to
trim). Everything is derived from ``random.Random`` instances seeded with strings
(SHA-512 based, independent of ``PYTHONHASHSEED``); nothing reads the wall clock.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from contextkit.layers import LayerConfig
from contextkit.prompt import PromptLine, PromptSection, StructuredPrompt, render_marked

if TYPE_CHECKING:
    from memory_graph.graph import MemoryGraph

__all__ = ["REPLAY_LAYERS", "AgentReplay", "ReplayTurn"]

REPLAY_LAYERS: tuple[str, ...] = (
    "axioms", "identity", "system_knowledge", "capabilities", "system_state", "current_time",
    "neurons", "memories", "affect", "awareness",
)

_Lines = list[tuple[str, float]]
_WORD = re.compile(r"[A-Za-z]+")

# ---------------------------------------------------------------------------- vocabulary

_CET = timezone(timedelta(hours=1), "CET")
_SESSION_DAY = datetime(2025, 3, 11, 17, 2, 0, tzinfo=_CET)  # a Tuesday
_HANDOFF = datetime(2025, 3, 11, 18, 0, 0, tzinfo=_CET)  # also the end of business hours

# name, owning team, base requests/s, base p95 ms, replicas
_SERVICES: tuple[tuple[str, str, int, int, int], ...] = (
    ("checkout-api", "checkout", 420, 185, 6),
    ("pricing-service", "checkout", 900, 38, 4),
    ("cart-service", "checkout", 610, 92, 4),
    ("payments-gateway", "payments", 150, 240, 4),
    ("web-frontend", "web", 2100, 160, 8),
    ("catalog-api", "catalog", 1200, 110, 6),
    ("search-api", "catalog", 520, 260, 5),
    ("auth-service", "platform", 1500, 35, 4),
    ("inventory-service", "catalog", 380, 70, 3),
    ("orders-worker", "checkout", 140, 310, 3),
    ("shipping-service", "fulfilment", 90, 150, 2),
    ("notifications-worker", "platform", 80, 300, 2),
    ("recommendations-api", "catalog", 300, 210, 3),
    ("image-resizer", "web", 60, 420, 3),
    ("admin-portal", "web", 12, 230, 2),
    ("reporting-etl", "data", 5, 1900, 1),
)
_SERVICE_NAMES = tuple(s[0] for s in _SERVICES)
_CUSTOMER_FACING = ("checkout-api", "cart-service", "payments-gateway", "web-frontend",
                    "catalog-api", "search-api", "pricing-service")
_CLUSTERS: tuple[tuple[str, str], ...] = (
    ("prod-eu", "eu-west-1"), ("prod-us", "us-east-1"), ("staging-eu", "eu-west-1"),
    ("batch-eu", "eu-west-1"),
)
_PEOPLE = ("Priya Raman", "Jonas Weber", "Marco Silva", "Aisha Okafor", "Tom Becker")

# ---------------------------------------------------------------------------- script

# (topic, user message, incident phase); phases drive the platform snapshot
_SCRIPT: tuple[tuple[str, str, str], ...] = (
    ("latency", "Atlas, we just got paged: checkout-api p95 latency alert in prod-eu. What does "
     "the current picture look like, and is anything else degraded?", "degraded"),
    ("latency", "Is this the database again? Check payments-db connections and slow queries for "
     "the last 30 minutes and compare with yesterday at the same time.", "degraded"),
    ("latency", "The database looks fine to me. Pull the slowest checkout traces from the last "
     "15 minutes and tell me which span is eating the time.", "degraded"),
    ("latency", "So most of the time is spent in calls to pricing-service. Did pricing-service "
     "itself get slower, or is checkout just calling it more often?", "degraded"),
    ("deploy", "Show me the checkout-api deploy history for today. I think Marco's team shipped "
     "something shortly before the alert started.", "degraded"),
    ("deploy", "Diff v2.13.2 against v2.14.0 for checkout-api. I want config changes, new "
     "downstream calls and any database migrations.", "degraded"),
    ("deploy", "How did the canary for v2.14.0 look? Why was it promoted if the latency was "
     "already bad?", "degraded"),
    ("rollback", "Okay, let's plan a rollback of checkout-api to v2.13.2. Walk me through the "
     "steps and the risks before you touch anything.", "degraded"),
    ("rollback", "No migrations, good. Confirmed: roll back checkout-api in prod-eu to v2.13.2, "
     "ticket PLAT-812, reason is the pricing call latency regression.", "rolling_back"),
    ("rollback", "Rollback is running. Watch p95 and error rate for the next few minutes and "
     "tell me when we are back under the SLO.", "recovering"),
    ("rollback", "Looks recovered. Should we also scale pricing-service back down, or leave the "
     "extra replicas until tomorrow morning?", "recovered"),
    ("incident", "Draft the incident summary for INC-2041 in our usual format. Include customer "
     "impact in failed checkouts and an estimate in EUR.", "recovered"),
    ("incident", "Add a timeline entry for the rollback and list follow-ups: a caching fix for "
     "the pricing call and a canary check on p95, with owners.", "recovered"),
    ("incident", "Post a short status update to #platform-incidents and mark the incident as "
     "mitigated, not resolved yet.", "mitigated"),
    ("cost", "Different topic while we wait: Lena from FinOps asked why last week's AWS bill "
     "went up. What were the top cost drivers?", "mitigated"),
    ("cost", "Break the NAT gateway cost down by service and tell me whether image-resizer is "
     "really the one pulling from S3 across zones.", "mitigated"),
    ("cost", "What would we save per month with an S3 gateway endpoint and the dev cluster "
     "scaled to zero at night?", "mitigated"),
    ("capacity", "The spring sale starts in nine days. Forecast checkout-api and payments-db "
     "capacity at three times normal traffic.", "mitigated"),
    ("capacity", "Compare that with what we needed during Black Friday. Are the current HPA "
     "minimums and limits enough?", "mitigated"),
    ("capacity", "Write a handoff note for Tom, who takes over on-call at 18:00: incident "
     "status, open tickets, and the capacity follow-up.", "mitigated"),
)

# the memory query of each topic: stable within a topic, whatever the exact message
_TOPIC_QUERIES: dict[str, str] = {
    "latency": "checkout-api p95 latency alert: past latency incidents, slow dependencies, "
               "database connection pool, traces",
    "deploy": "checkout-api deploys and releases: canary results, config changes, release "
              "diffs, deploy windows",
    "rollback": "rolling back a service to the previous release: migrations, readiness, "
                "lessons from past rollbacks",
    "incident": "writing an incident summary and postmortem: customer impact, timeline, "
                "follow-up actions and owners",
    "cost": "AWS cost increase week over week: NAT gateway, S3 traffic, FinOps questions, "
            "savings decisions",
    "capacity": "capacity planning for a sale event: traffic peaks, replicas, HPA, "
                "payments-db limits, load tests",
}
_RELATED: dict[str, tuple[str, ...]] = {
    "latency": ("deploy",),
    "deploy": ("latency", "rollback"),
    "rollback": ("deploy", "incident"),
    "incident": ("rollback", "latency"),
    "cost": ("capacity",),
    "capacity": ("cost", "latency"),
}

# ---------------------------------------------------------------------------- stable layers

_AXIOMS: _Lines = [
    ("Safety first: never run a destructive or irreversible action (delete, drain, scale to "
     "zero, DROP, force push) without an explicit yes from the user in this conversation.", 1.0),
    ("Honesty: say what you checked, what you inferred and what you do not know; never invent "
     "metrics, log lines or command output.", 1.0),
    ("Protect customer data: never paste secrets, tokens or personal data into chat, tickets "
     "or pages.", 0.95),
    ("Prefer the smallest reversible change that restores service; mitigation comes before "
     "root cause.", 0.9),
    ("Leave a trail: every change links to a ticket or incident with what, why and how to "
     "undo it.", 0.85),
    ("Respect the humans on call: page only when the escalation policy says so, and say "
     "why.", 0.8),
    ("When unsure whether an action is safe, stop and ask; a short delay is cheaper than an "
     "outage.", 0.9),
]

_IDENTITY: _Lines = [
    ("You are Atlas, the SRE and DevOps assistant of the Brightloom platform team.", 1.0),
    ("Brightloom is a 40-person online retailer of outdoor gear; its platform team of six runs "
     "the Kubernetes clusters in AWS eu-west-1 and us-east-1, the CI/CD pipeline and the "
     "on-call rotation.", 0.8),
    ("You serve the platform engineers first, then backend developers who need help with "
     "deploys, and sometimes FinOps with cost questions.", 0.7),
    ("Voice: calm, direct and concise; lead with the answer, then the evidence; plain English, "
     "exact numbers with units.", 0.9),
    ("During an open SEV1 or SEV2 keep replies short: status, next action, owner.", 0.85),
    ("You can read clusters, metrics, logs, traces and tickets; write actions go through the "
     "deploy, rollback, scale, flag and ticket tools and need confirmation.", 0.9),
    ("People: Priya Raman (platform lead, default incident commander), Jonas Weber and Tom "
     "Becker (SRE), Marco Silva (checkout backend lead), Aisha Okafor (payments), Lena Fischer "
     "(FinOps).", 0.6),
    ("You have no write access to production databases and never ask for it.", 0.5),
    ("Format: short paragraphs or bullets, code blocks for commands and queries, no emojis.",
     0.55),
]

_SYSTEM_KNOWLEDGE: _Lines = [
    ("Severity: SEV1 = checkout or payments down, or data loss risk; SEV2 = SLO burn above 10x "
     "for 15 min or a major feature degraded; SEV3 = degraded non-critical service; SEV4 = "
     "cosmetic.", 1.0),
    ("SLOs: checkout-api p95 under 300 ms and 99.9% availability over 30 days; "
     "payments-gateway 99.95% availability; search-api p95 under 500 ms.", 0.95),
    ("Escalation: SEV1 pages primary and secondary on-call and the incident commander; SEV2 "
     "pages the primary only; SEV3 and SEV4 get a PLAT ticket, no page.", 0.9),
    ("If the primary does not acknowledge within 10 minutes, page the secondary; after 20 "
     "minutes, page Priya Raman.", 0.75),
    ("Change management: production deploys need a green CI run, one approving review and a "
     "linked ticket; no deploys during a change freeze without the incident commander.", 0.85),
    ("Change freezes: Fridays after 15:00 CET, public holidays, and 48 hours before announced "
     "sales.", 0.6),
    ("Rollbacks to the previous release are pre-approved during an active SEV1 or SEV2; "
     "database migrations are never rolled back automatically.", 0.9),
    ("Canary policy: a release runs on 10% of pods for 15 minutes and is promoted only if "
     "error rate and p95 stay within 10% of baseline.", 0.7),
    ("Incident summaries: Summary, Impact (customers, duration, EUR estimate), Timeline in CET, "
     "Root cause, Mitigation, Follow-ups with owners and due dates.", 0.8),
    ("Tickets: title under 80 characters, component label, severity, links to dashboards and "
     "the incident.", 0.5),
    ("Report times in CET (UTC in brackets for incidents); every number carries a unit; name "
     "the dashboard or query and window behind each metric.", 0.65),
    ("Cost figures come from the daily AWS cost export in EUR excluding VAT and lag by up to "
     "24 hours.", 0.4),
    ("On-call: the primary covers 09:00-18:00 CET on weekdays and is paged after hours; "
     "handoffs happen at 18:00 CET with a written note.", 0.55),
    ("During a SEV1 or SEV2, post a status update to #platform-incidents every 30 minutes, "
     "even when nothing changed.", 0.7),
    ("Access requests, secret rotation and IAM changes go to the security team's SEC queue, "
     "never through Atlas.", 0.45),
]

_CAPABILITIES: _Lines = [
    ("Tools take JSON arguments; durations like 15m, times as ISO 8601 or now. Read tools run "
     "freely; deploy, rollback, scale, flag changes and pages need an explicit yes.", 1.0),
    ("kubectl_get(cluster: str, namespace: str, kind: str, name: str = '', selector: str = '') "
     "-> table: read-only listing of pods, deployments, HPAs, nodes or events.", 0.95),
    ("kubectl_describe(cluster: str, namespace: str, kind: str, name: str) -> text: full "
     "object description with conditions and recent events.", 0.7),
    ("pod_logs(cluster: str, namespace: str, pod: str, container: str = '', since: duration "
     "= '15m', grep: str = '') -> lines: tail one pod's logs, at most 2,000 lines.", 0.75),
    ("log_search(query: str, service: str = '', since: duration = '1h', limit: int = 200) "
     "-> events: LogQL search in Loki across services, newest first.", 0.9),
    ("metrics_query(promql: str, start: time, end: time = 'now', step: duration = '1m') -> "
     "series: PromQL range query against Thanos.", 0.95),
    ("slo_status(service: str, window: duration = '30d') -> report: error budget left and burn "
     "rates over 1h and 6h.", 0.8),
    ("trace_search(service: str, min_duration_ms: int = 0, since: duration = '30m', limit: int "
     "= 20) -> traces: slowest Tempo traces with span breakdown.", 0.85),
    ("dashboard_link(name: str, vars: dict = {}) -> url: Grafana link to a named dashboard.",
     0.3),
    ("runbook_lookup(topic: str) -> markdown: best runbook page and its last-reviewed date.",
     0.6),
    ("deploy_history(service: str, limit: int = 10) -> list: releases with version, commit, "
     "author, time, CI run and canary verdict.", 0.85),
    ("diff_release(service: str, from_version: str, to_version: str) -> summary: commits, "
     "config changes, new downstream calls and migrations between releases.", 0.85),
    ("deploy(service: str, version: str, cluster: str, strategy: str = 'canary', ticket: str) "
     "-> job: start a production deploy; needs confirmation and a ticket.", 0.8),
    ("rollback(service: str, cluster: str, to_version: str = 'previous', reason: str, ticket: "
     "str) -> job: roll back a deployment; needs confirmation; never reverts migrations.", 0.95),
    ("scale(service: str, cluster: str, replicas: int, reason: str) -> job: set the replica "
     "count; 0 replicas needs a second confirmation.", 0.7),
    ("feature_flag(flag: str, action: str = 'get', percent: int = 100) -> state: read, enable "
     "or disable a LaunchDarkly flag; changes need confirmation.", 0.5),
    ("db_query_readonly(database: str, sql: str, timeout_s: int = 10) -> rows: SELECT or "
     "EXPLAIN on a read replica; anything else is rejected.", 0.75),
    ("queue_status(queue: str) -> stats: Kafka consumer lag, consumers and throughput per "
     "partition.", 0.55),
    ("ticket_create(queue: str, title: str, body: str, severity: str, labels: list[str] = []) "
     "-> key: open a Jira ticket.", 0.65),
    ("ticket_update(key: str, comment: str, status: str = '') -> key: comment on or transition "
     "a ticket.", 0.45),
    ("incident_open(title: str, severity: str, commander: str = '') -> id: open an incident "
     "record and channel; pages per the escalation policy.", 0.6),
    ("incident_update(incident: str, status: str = '', timeline_entry: str = '') -> ok: change "
     "status or append a timeline entry (time in CET).", 0.6),
    ("page_oncall(schedule: str, message: str, incident: str = '') -> page: page primary, "
     "secondary or lead through PagerDuty; always state the reason.", 0.7),
    ("oncall_who(schedule: str = 'platform', at: time = 'now') -> people: who is on call.",
     0.35),
    ("cost_query(group_by: str, start: date, end: date, filter: str = '') -> table: daily AWS "
     "cost in EUR by service, team, account or usage type.", 0.4),
    ("capacity_forecast(service: str, horizon_days: int = 14, traffic_multiplier: float = 1.0) "
     "-> forecast: projected CPU, memory, connections and replicas.", 0.4),
    ("post_message(channel: str, text: str) -> ok: post to Slack; use #platform-incidents "
     "during incidents.", 0.5),
    ("load_test_report(name: str) -> report: peak req/s, p95 and first saturated resource "
     "of a past load test.", 0.25),
    ("node_status(cluster: str, pool: str = '') -> table: node readiness, pressure conditions, "
     "allocatable versus requested CPU and memory.", 0.5),
    ("hpa_status(service: str, cluster: str) -> state: current, min and max replicas, target "
     "and observed utilisation, last scale event.", 0.65),
    ("alert_list(state: str = 'firing', severity: str = '') -> alerts: Alertmanager alerts "
     "with labels, start time and silence status.", 0.6),
    ("silence_alert(matcher: str, duration: duration, reason: str) -> id: silence matching "
     "alerts for at most 4h; needs confirmation.", 0.45),
    ("config_get(service: str, cluster: str, key: str = '') -> values: effective ConfigMap and "
     "environment values, secrets masked.", 0.55),
    ("cert_status(domain: str = '') -> list: TLS certificates with issuer and days until "
     "expiry.", 0.2),
    ("ci_status(pipeline: str, branch: str = 'main') -> runs: recent CI runs with status, "
     "duration and the failing step.", 0.3),
]

_AFFECT: _Lines = [
    ("Mood: focused and steady; the incident is serious but contained, so no alarm in the "
     "tone.", 0.9),
    ("Confidence: moderate about the cause until the evidence is in, high about the data "
     "sources and tools.", 0.8),
    ("Tone toward Jonas: collegial and brief; he is under time pressure near the end of his "
     "on-call shift.", 0.85),
    ("Stress signal: his messages are short and fast; avoid long lists and hedging.", 0.7),
    ("Energy: keep momentum; acknowledge small wins (alert cleared, ticket filed) in a few "
     "words, then move on.", 0.5),
    ("Patience: high; if a question repeats, answer it again without comment.", 0.35),
    ("Humor: none while the incident is open; a light touch is fine once it is mitigated.",
     0.25),
    ("Caution: elevated; he may approve actions quickly, so restate the exact target before "
     "each write.", 0.75),
    ("Empathy: acknowledge the pressure of the handoff deadline once, without dwelling on it.",
     0.45),
    ("Curiosity: note odd details, such as the pricing call volume, for the postmortem even "
     "when they are not urgent.", 0.3),
]

_AWARENESS_BASE: _Lines = [
    ("Session goal 1: find and mitigate the cause of the checkout-api p95 latency alert "
     "(INC-2041, SEV2, prod-eu).", 1.0),
    ("Session goal 2: leave an incident summary and follow-up tickets before the 18:00 CET "
     "on-call handoff to Tom Becker.", 0.9),
    ("Session goal 3: answer the FinOps question about last week's AWS cost increase, and "
     "check capacity for the spring sale.", 0.6),
    ("User: Jonas Weber, SRE and primary on-call this week; expert with Kubernetes, PromQL and "
     "Postgres, newer to the checkout and pricing code.", 0.9),
    ("Expertise signal: he writes PromQL himself and skims explanations; give queries, numbers "
     "and commands, skip the basics.", 0.7),
    ("Situation: a live incident; answer short, propose one next step at a time, confirm "
     "before any write action.", 0.85),
    ("Watching: Priya Raman (incident commander) in #platform-incidents; Marco Silva's team "
     "owns checkout-api and pricing-service.", 0.55),
    ("Risks: a change freeze starts Friday 15:00 CET and the spring sale starts on 20 March.",
     0.45),
    ("Do not repeat: the team knows the SLO definitions and the escalation policy.", 0.3),
    ("Progress markers: cause found, rollback done, summary drafted, tickets filed, handoff "
     "note written.", 0.65),
    ("Channel: a direct chat in the Atlas console; replies may be pasted into Slack, so keep "
     "them self-contained.", 0.4),
    ("Jonas's shift ends at 18:00 CET; after that Tom Becker owns anything left open.", 0.5),
    ("Preferred output: commands in code blocks and at most one table per reply.", 0.35),
]

# ---------------------------------------------------------------------------- neurons

_NEURONS_CORE: tuple[tuple[str, float, int], ...] = (
    ("When checkout-api p95 rises within an hour of a deploy, diff the release before looking "
     "at the database", 0.88, 17),
    ("When p95 rises but p50 stays flat, suspect one slow dependency or one bad node rather "
     "than general load", 0.81, 22),
    ("When payments-db connections pass 320 of 400, look for a long report query or a leaked "
     "transaction before adding pods", 0.84, 9),
    ("When a canary passes but production degrades, check whether the canary saw real traffic "
     "and whether a flag hid the new path", 0.77, 6),
    ("Before any rollback, check diff_release for migrations; forward-only migrations make "
     "the old version fail readiness", 0.93, 11),
    ("After a rollback, expect 3-5 minutes of elevated p95 from cold caches; do not call it "
     "failed before 10 minutes", 0.79, 8),
    ("Week-over-week cost jumps above 15% are usually one forgotten resource, not organic "
     "growth", 0.72, 12),
    ("NAT gateway cost growth usually means cross-AZ or S3 traffic without a gateway "
     "endpoint", 0.83, 5),
    ("Sale traffic exhausts payments-db connections before CPU; forecast connections first",
     0.76, 4),
    ("Jonas trusts traces more than dashboards; lead with a trace id when there is one", 0.69,
     14),
    ("Incident summaries get sent back when impact is only a percentage; give orders and EUR",
     0.86, 7),
    ("Consumer lag that grows while throughput is flat means a poison message or a stuck "
     "partition, not too few consumers", 0.74, 10),
    ("Alerts between 16:00 and 18:00 CET often follow the checkout team's release window",
     0.71, 9),
)

# symptom -> what to check first
_SYMPTOMS: tuple[tuple[str, str], ...] = (
    ("rising p95 latency", "downstream connection pools and the slow query log"),
    ("a 5xx spike", "the last deploy and the error rates of its upstream dependencies"),
    ("OOMKilled restarts", "memory limits against the 24 h working set"),
    ("growing consumer lag", "consumer pod count, partition skew and poison messages"),
    ("CPU throttling", "CPU limits and the HPA target utilisation"),
    ("elevated 4xx responses", "auth-service token errors and recent client releases"),
    ("timeouts to a dependency", "network policy changes and DNS lookup latency"),
    ("a cache hit ratio drop", "redis evictions and recent TTL changes"),
    ("slow pod startup", "image size, readiness probe timing and node scale-up events"),
    ("connection resets", "load balancer idle timeouts and keep-alive settings"),
)
_DEPLOY_SIGNS: tuple[tuple[str, str], ...] = (
    ("p95 up more than 20% within 10 minutes", "a new synchronous downstream call"),
    ("error rate up but only on one route", "a changed request schema or validation rule"),
    ("memory climbing steadily", "a cache without a size bound"),
    ("readiness failures on new pods", "a config key missing in one cluster"),
    ("log volume doubling", "a debug log level left on"),
)


def _confidence_importance(confidence: float) -> float:
    return round(min(1.0, max(0.2, (confidence - 0.45) / 0.5)), 2)


# ---------------------------------------------------------------------------- memories

@dataclass(frozen=True)
class _Memory:
    key: str  # stable id suffix: "<topic>-<j>" or "general-<j>"
    text: str
    kind: str  # "episodic" | "semantic"
    topics: tuple[str, ...]  # its own topic first; general memories list the topics they fit
    importance: float
    date: str  # YYYY-MM-DD, used as created_at in a memory graph
    general: bool


_MEMORY_TEMPLATES: dict[str, tuple[tuple[str, str], ...]] = {
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

# choices may use the basic slots of _memory_slots ({svc}, {ver_new}, {slo_ms}, ...)
_SLOT_CHOICES: dict[str, tuple[str, ...]] = {
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

_GENERAL_MEMORIES: tuple[tuple[str, str, tuple[str, ...], float, str], ...] = (
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

# ---------------------------------------------------------------------------- sizing

# at scale=1: line counts of the generated layers and the memories' token allowance,
# calibrated so each layer lands at 80-95% of its default budget (SmolLM2 tokens)
_BASE_NEURON_LINES = 38
_BASE_STATE_LINES = 18
_BASE_MEMORY_TOKENS = 990  # estimated with _estimate_tokens
_BASE_AWARENESS_LINES = len(_AWARENESS_BASE)
_EXPANDABLE = ("system_state", "neurons", "memories", "awareness")


def _rng(seed: int, *parts: object) -> random.Random:
    """A generator seeded from a string (SHA-512 based; PYTHONHASHSEED does not matter)."""
    return random.Random(":".join(str(p) for p in ("contextkit-replay", seed, *parts)))


def _multipliers(scale: float) -> dict[str, float]:
    """Content multiplier per expandable layer so the prompt grows about ``scale``-fold."""
    config = LayerConfig()
    out: dict[str, float] = {}
    for name in _EXPANDABLE:
        spec = config.get(name)
        headroom = spec.expanded_budget / spec.budget - 1.0
        out[name] = scale if scale < 1.0 else 1.0 + (scale - 1.0) * headroom / 2.0
    return out


def _date(rng: random.Random) -> str:
    day = datetime(2024, 1, 8) + timedelta(days=rng.randrange(0, 420))
    return day.strftime("%Y-%m-%d")


def _memory_slots(rng: random.Random) -> dict[str, str]:
    """Every slot any memory template uses, drawn in one fixed order."""
    minor = rng.randrange(6, 14)
    count_of = rng.randrange(4, 9)
    slots = dict(
        date=_date(rng),
        inc=f"INC-{rng.randrange(1500, 2035)}",
        svc=rng.choice(_CUSTOMER_FACING),
        person=rng.choice(_PEOPLE),
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
    for name, values in _SLOT_CHOICES.items():
        slots[name] = rng.choice(values).format(**basic)
    return slots


# ---------------------------------------------------------------------------- public API

@dataclass(frozen=True)
class ReplayTurn:
    """One scripted turn of the replay.

    Attributes:
        index: 0-based turn number.
        user_message: what the user says on this turn.
        topic: the conversation topic (``latency``, ``deploy``, ``rollback``,
            ``incident``, ``cost`` or ``capacity``); memories follow it.
        changed_layers: layers whose text differs from the previous turn, in
            :data:`REPLAY_LAYERS` order (all layers on turn 0).
    """

    index: int
    user_message: str
    topic: str
    changed_layers: tuple[str, ...]


class AgentReplay:
    """The deterministic replay: a layered system prompt per turn of a scripted session.

    Args:
        turns: number of turns (>= 1); beyond the 20 scripted messages the script
            repeats while the clock and the platform snapshot move on.
        seed: seed of every generated number and choice.
        scale: content multiplier of the expandable layers (``system_state``,
            ``neurons``, ``memories``, ``awareness``): 1.0 fits the default budgets
            (about 6K tokens); larger values grow the whole prompt about ``scale``-fold
            (5.0: about 30K tokens, beyond the expanded budgets, for trimming);
            values below 1 shrink those layers.
        memory_graph: when given, ``memories`` come from
            :func:`memory_graph.layer.memories_layer_lines` with a query that depends
            only on the topic (seed the graph with :meth:`seed_memory` first); the
            graph is queried once per topic and instance, so a new instance sees
            later graph changes. Otherwise memories are a scripted, topic-keyed
            selection of :meth:`memory_corpus`. Either way they are cut to the
            layer's size (about 960 tokens at ``scale=1``), best first.
        tenant: the memory graph tenant used for seeding and queries.

    Raises:
        ValueError: ``turns < 1`` or ``scale <= 0``.
    """

    def __init__(self, turns: int = 20, *, seed: int = 0, scale: float = 1.0,
                 memory_graph: MemoryGraph | None = None, tenant: str = "default") -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.num_turns = int(turns)
        self.seed = int(seed)
        self.scale = float(scale)
        self.memory_graph = memory_graph
        self.tenant = tenant
        mult = _multipliers(self.scale)
        self._state_lines = max(1, round(_BASE_STATE_LINES * mult["system_state"]))
        self._neuron_lines = max(1, round(_BASE_NEURON_LINES * mult["neurons"]))
        self._memory_tokens = max(1, round(_BASE_MEMORY_TOKENS * mult["memories"]))
        self._awareness_lines = max(1, round(_BASE_AWARENESS_LINES * mult["awareness"]))
        self._memories = self._build_memories(mult["memories"])
        self._topic_memories: dict[str, _Lines] = {}
        self._times = self._build_times()
        self._constant: dict[str, tuple[PromptLine, ...]] = {
            "axioms": _prompt_lines(_AXIOMS),
            "identity": _prompt_lines(_IDENTITY),
            "system_knowledge": _prompt_lines(_SYSTEM_KNOWLEDGE),
            "capabilities": _prompt_lines(_CAPABILITIES),
            "neurons": _prompt_lines(self._neurons()),
            "affect": _prompt_lines(_AFFECT),
            "awareness": _prompt_lines(self._awareness()),
        }

    # ------------------------------------------------------------------ turns
    def _check(self, i: int) -> int:
        if not 0 <= i < self.num_turns:
            raise IndexError(f"turn {i} is out of range; this replay has turns 0.."
                             f"{self.num_turns - 1}")
        return i

    def _script(self, i: int) -> tuple[str, str, str]:
        return _SCRIPT[i % len(_SCRIPT)]

    def turn(self, i: int) -> ReplayTurn:
        """Turn ``i`` (0-based) with its message, topic and changed layers.

        Raises:
            IndexError: ``i`` outside ``0..num_turns-1``.
        """
        self._check(i)
        topic, message, _ = self._script(i)
        changed = REPLAY_LAYERS if i == 0 else _diff(self._sections(i - 1), self._sections(i))
        return ReplayTurn(i, message, topic, changed)

    def turns(self) -> list[ReplayTurn]:
        """All turns in order (each prompt is built once)."""
        out: list[ReplayTurn] = []
        prev: dict[str, tuple[PromptLine, ...]] | None = None
        for i in range(self.num_turns):
            cur = self._sections(i)
            changed = REPLAY_LAYERS if prev is None else _diff(prev, cur)
            topic, message, _ = self._script(i)
            out.append(ReplayTurn(i, message, topic, changed))
            prev = cur
        return out

    def build_system_message(self, turn: int) -> StructuredPrompt:
        """The layered system prompt of ``turn``: sections in :data:`REPLAY_LAYERS` order.

        Raises:
            IndexError: ``turn`` outside ``0..num_turns-1``.
        """
        self._check(turn)
        sections = self._sections(turn)
        return StructuredPrompt(tuple(PromptSection(name, sections[name])
                                      for name in REPLAY_LAYERS))

    def build_marked(self, turn: int) -> str:
        """The prompt of ``turn`` as a ``[AXIOMS]...[/AXIOMS]...`` marker string."""
        return render_marked(self.build_system_message(turn))

    def _sections(self, i: int) -> dict[str, tuple[PromptLine, ...]]:
        topic, _, _ = self._script(i)
        out = dict(self._constant)
        out["system_state"] = _prompt_lines(self._system_state(i))
        out["current_time"] = _prompt_lines(self._current_time(i))
        out["memories"] = _prompt_lines(self._memory_lines(topic))
        return out

    # ------------------------------------------------------------------ memories
    def memory_corpus(self) -> list[str]:
        """Texts of the replay's memories (topic episodes and decisions, then general facts)."""
        return [m.text for m in self._memories]

    def seed_memory(self, graph: MemoryGraph) -> int:
        """Add the memory corpus to ``graph`` for :attr:`tenant`, with typed edges.

        Node ids are deterministic (``replay:<tenant>:<seed>:<key>``); memories already
        present are skipped, so seeding twice adds nothing. ``created_at`` is each
        memory's date, so the recency signal is the same whatever the wall clock.

        Edges: ``same_topic`` (0.5) between consecutive memories of a topic,
        ``follow_up_of`` (0.8) from a decision or lesson to the latest episode before
        it, ``applies_to`` (0.6) from a general memory to the first memory of each
        topic it fits.

        Returns:
            The number of nodes added.
        """
        ids = [f"replay:{self.tenant}:{self.seed}:{m.key}" for m in self._memories]
        new = [i for i, nid in enumerate(ids) if nid not in graph]
        if new:
            graph.add_nodes(
                [self._memories[i].text for i in new], tenant=self.tenant,
                kinds=[self._memories[i].kind for i in new], node_ids=[ids[i] for i in new],
                created_at=[datetime.strptime(self._memories[i].date, "%Y-%m-%d")
                            .replace(tzinfo=timezone.utc).timestamp() for i in new])
        fresh = set(new)
        edges = [(ids[a], ids[b], kind, w) for a, b, kind, w in self._memory_edges()
                 if a in fresh or b in fresh]
        if edges:
            graph.add_edges(edges)
        return len(new)

    def _memory_edges(self) -> list[tuple[int, int, str, float]]:
        first: dict[str, int] = {}
        prev: dict[str, int] = {}
        last_episode: dict[str, int] = {}
        edges: list[tuple[int, int, str, float]] = []
        for i, m in enumerate(self._memories):
            if m.general:
                edges.extend((i, first[t], "applies_to", 0.6) for t in m.topics if t in first)
                continue
            topic = m.topics[0]
            first.setdefault(topic, i)
            if topic in prev:
                edges.append((i, prev[topic], "same_topic", 0.5))
            if m.kind == "semantic" and topic in last_episode:
                edges.append((i, last_episode[topic], "follow_up_of", 0.8))
            if m.kind == "episodic":
                last_episode[topic] = i
            prev[topic] = i
        return edges

    def _build_memories(self, mult: float) -> list[_Memory]:
        per_topic = max(1, round(9 * mult))
        out: list[_Memory] = []
        for topic, templates in _MEMORY_TEMPLATES.items():
            for j in range(per_topic):
                rng = _rng(self.seed, "memory", topic, j)
                slots = _memory_slots(rng)
                kind, template = templates[j % len(templates)]
                out.append(_Memory(f"{topic}-{j}", template.format(**slots), kind, (topic,),
                                   round(rng.uniform(0.55, 1.0), 2), slots["date"], False))
        for j, (text, kind, topics, importance, date) in enumerate(_GENERAL_MEMORIES):
            out.append(_Memory(f"general-{j}", text, kind, topics, importance, date, True))
        return out

    def _memory_lines(self, topic: str) -> _Lines:
        """The memories of ``topic``, computed (or queried) once per topic and instance."""
        cached = self._topic_memories.get(topic)
        if cached is None:
            cached = (self._scripted_memory_lines(topic) if self.memory_graph is None
                      else self._graph_memory_lines(topic))
            self._topic_memories[topic] = cached
        return list(cached)

    def _scripted_memory_lines(self, topic: str) -> _Lines:
        """Best-first memories for ``topic``: its own, then general and related ones."""
        related = _RELATED.get(topic, ())

        def relevance(m: _Memory) -> float:
            if m.general:
                return 0.7 if topic in m.topics else 0.4
            if m.topics[0] == topic:
                return 1.0
            return 0.55 if m.topics[0] in related else 0.15

        scored = sorted(((relevance(m) * m.importance, i) for i, m in
                         enumerate(self._memories)), key=lambda s: (-s[0], s[1]))
        return _fill_tokens([(self._memories[i].text, _clamp(score)) for score, i in scored],
                            self._memory_tokens)

    def _graph_memory_lines(self, topic: str) -> _Lines:
        from memory_graph.layer import memories_layer_lines

        assert self.memory_graph is not None
        avg = sum(_estimate_tokens(m.text) for m in self._memories) / len(self._memories)
        k = max(4, math.ceil(self._memory_tokens / avg))
        lines = memories_layer_lines(self.memory_graph, _TOPIC_QUERIES[topic], self.tenant,
                                     k=k, hops=1)
        return _fill_tokens([(text, _clamp(imp)) for text, imp in lines], self._memory_tokens)

    # ------------------------------------------------------------------ generated layers
    def _neurons(self) -> _Lines:
        head = ("Learned heuristics; confidence is the share of past cases where this first "
                "check found the cause.", 0.9)
        return [head, *_take(self._neuron_stream(), self._neuron_lines - 1)]

    def _neuron_stream(self) -> Iterator[tuple[str, float]]:
        for text, conf, seen in _NEURONS_CORE:
            yield f"{text} (confidence {conf:.2f}, seen {seen}x).", _confidence_importance(conf)
        # (template, a, b): symptom -> first check, deploy sign -> cause, co-failing pair
        generated: list[tuple[str, str, str]] = []
        for svc in _SERVICE_NAMES:
            generated.extend(("When {a} shows {b}, check {c} first", svc, symptom)
                             for symptom, _ in _SYMPTOMS)
            generated.extend(("After {a} deploys, {b} usually means {c}", svc, sign)
                             for sign, _ in _DEPLOY_SIGNS)
        generated.extend(("{a} and {b} degraded together in {c}% of past incidents; check both "
                          "when either alerts", _SERVICE_NAMES[i], _SERVICE_NAMES[j])
                         for i in range(len(_SERVICE_NAMES))
                         for j in range(i + 1, len(_SERVICE_NAMES)))
        _rng(self.seed, "neuron-order").shuffle(generated)
        follow = dict(_SYMPTOMS) | dict(_DEPLOY_SIGNS)
        rounds = 0
        while True:  # later rounds (only at large scales) scope the pool to one cluster
            for n, (template, a, b) in enumerate(generated):
                rng = _rng(self.seed, "neuron", rounds, n)
                c = follow.get(b) or str(rng.randrange(20, 75))
                text = template.format(a=a, b=b, c=c)
                if rounds:
                    cluster = _CLUSTERS[rounds % len(_CLUSTERS)][0]
                    variant = f" (variant {rounds // len(_CLUSTERS)})" \
                        if rounds >= len(_CLUSTERS) else ""
                    text = f"In {cluster}{variant}: {text[0].lower()}{text[1:]}"
                conf = rng.uniform(0.52, 0.92)
                yield (f"{text} (confidence {conf:.2f}, seen {rng.randrange(2, 41)}x).",
                       _confidence_importance(conf))
            rounds += 1

    def _awareness(self) -> _Lines:
        return _take(self._awareness_stream(), self._awareness_lines)

    def _awareness_stream(self) -> Iterator[tuple[str, float]]:
        yield from _AWARENESS_BASE
        n = 0
        while True:
            rng = _rng(self.seed, "awareness", n)
            svc = rng.choice(_SERVICE_NAMES)
            date = _date(rng)
            choice = n % 3
            if choice == 0:
                text = (f"Earlier session {date}: Jonas asked about {svc} "
                        f"{rng.choice(('latency', 'restarts', 'cost', 'replicas', 'errors'))}; "
                        f"he used the answer and asked for the PromQL.")
            elif choice == 1:
                status = rng.choice(_SLOT_CHOICES["followup_status"])
                text = (f"Open thread from {date}: {svc} follow-up ticket "
                        f"PLAT-{rng.randrange(600, 811)} is {status}.")
            else:
                text = (f"Context: {svc} is owned by the {_SERVICES[_SERVICE_NAMES.index(svc)][1]}"
                        f" team; Jonas last touched its dashboards on {date}.")
            yield text, round(rng.uniform(0.2, 0.6), 2)
            n += 1

    # ------------------------------------------------------------------ per-turn layers
    def _build_times(self) -> list[datetime]:
        start = _SESSION_DAY + timedelta(seconds=_rng(self.seed, "start").randrange(0, 300))
        times = [start]
        for i in range(1, self.num_turns):
            times.append(times[-1] + timedelta(seconds=_rng(self.seed, "dt", i)
                                               .randrange(50, 200)))
        return times

    def _current_time(self, i: int) -> _Lines:
        now, start = self._times[i], self._times[0]
        lines: _Lines = [(f"Now: {now:%A} {now.day} {now:%B %Y}, {now:%H:%M:%S} CET (UTC+1).",
                          1.0)]
        if now < _HANDOFF:
            left = math.ceil((_HANDOFF - now).total_seconds() / 60)
            lines.append((f"Business hours: yes, {left} min left; handoff to Tom at 18:00.",
                          0.6))
        else:
            lines.append(("Business hours: no; Tom Becker is on-call since 18:00.", 0.6))
        elapsed = int((now - start).total_seconds() // 60)
        lines.append((f"Session started {start:%H:%M}, {elapsed} min ago; turn {i + 1}.", 0.7))
        return lines

    def _system_state(self, i: int) -> _Lines:
        return _take(self._state_stream(i), self._state_lines)

    def _state_stream(self, i: int) -> Iterator[tuple[str, float]]:
        _, _, phase = self._script(i)
        pos = i % len(_SCRIPT)
        rng = _rng(self.seed, "state", i)
        now = self._times[i]
        yield (f"Platform snapshot at {now:%H:%M:%S} CET (Prometheus, scrape age "
               f"{rng.randrange(2, 15)} s).", 0.9)
        status = {
            "degraded": "investigating" if pos else "acknowledged by Jonas Weber",
            "rolling_back": "mitigating, rollback of checkout-api in progress",
            "recovering": "mitigating, rollback done, p95 recovering",
            "recovered": "monitoring after rollback",
            "mitigated": "mitigated, summary drafted",
        }[phase]
        yield (f"Open: INC-2041 SEV2 checkout-api p95 above SLO since 16:58 CET, {status}, "
               f"commander Priya Raman.", 1.0)
        yield ("Open: INC-2039 SEV3 search-api 4xx from a scraping bot, rate limit applied, "
               "monitoring.", 0.45)
        alerts = {
            "degraded": "CheckoutP95AboveSLO (critical), PricingServiceHighRPS (warning)",
            "rolling_back": "CheckoutP95AboveSLO (critical), PricingServiceHighRPS (warning)",
            "recovering": "CheckoutP95AboveSLO (resolving)",
            "recovered": "none new",
            "mitigated": "none new",
        }[phase]
        yield f"Firing alerts besides SearchApi4xxRate: {alerts}.", 0.85
        if phase == "rolling_back":
            yield (f"Job rollback checkout-api v2.14.0 -> v2.13.2 (prod-eu): "
                   f"{rng.randrange(2, 5)}/6 pods replaced, PLAT-812.", 0.95)
        elif phase == "recovering":
            yield ("Job rollback checkout-api v2.14.0 -> v2.13.2 (prod-eu): 6/6 pods replaced, "
                   "waiting on caches.", 0.9)
        elif phase == "degraded":
            yield "checkout-api prod-eu runs v2.14.0 since 16:41 CET; no deploy in progress.", 0.7
        else:
            rolled = self._times[i - pos + 8]  # the turn the rollback ran
            yield (f"checkout-api prod-eu runs v2.13.2 since {rolled:%H:%M} CET (rollback); no "
                   "deploy in progress.", 0.7)
        yield from self._datastore_lines(rng, phase)
        services = [(s, c) for c in range(len(_CLUSTERS)) for s in range(len(_SERVICES))]
        for n, (s, c) in enumerate(services):
            yield self._service_line(rng, s, c, phase, pos)
            if n == 7:
                yield from self._queue_and_job_lines(rng, pos)
        k = 0
        while True:  # per-pod detail, only at larger scales
            svc = _SERVICE_NAMES[k % len(_SERVICE_NAMES)]
            pod = _rng(self.seed, "pod", k).getrandbits(24)
            yield (f"Pod {svc}-{pod:06x} (prod-eu): restarts {rng.randrange(0, 3)}, CPU "
                   f"{rng.randrange(40, 900)}m, mem {rng.randrange(120, 1900)} MiB, node "
                   f"ip-10-0-{rng.randrange(1, 60)}-{rng.randrange(2, 250)}.", 0.2)
            k += 1

    def _datastore_lines(self, rng: random.Random, phase: str) -> Iterator[tuple[str, float]]:
        conns = rng.randrange(150, 230)
        yield (f"payments-db (RDS Postgres 15): {conns}/400 connections, CPU "
               f"{rng.randrange(28, 46)}%, replica lag {rng.randrange(4, 90)} ms, slow queries "
               f"{rng.randrange(0, 4)}/min.", 0.8)
        hit = rng.uniform(93.0, 97.5) if phase in ("degraded", "rolling_back") \
            else rng.uniform(97.0, 99.2)
        yield (f"redis-sessions: hit ratio {hit:.1f}%, memory {rng.uniform(3.2, 4.4):.1f}/6 GiB, "
               f"evictions {rng.randrange(0, 9)}/s.", 0.55)

    def _queue_and_job_lines(self, rng: random.Random, pos: int) -> Iterator[tuple[str, float]]:
        yield (f"Queue orders-events: lag {rng.randrange(40, 2400):,} msgs, "
               f"{rng.randrange(6, 9)} consumers.", 0.5)
        yield (f"Queue payment-callbacks: lag {rng.randrange(0, 300):,} msgs, "
               f"{rng.randrange(2, 5)} consumers.", 0.55)
        yield (f"Job reporting-etl hourly rollup: {min(99, 8 + pos * 4 + rng.randrange(0, 4))}% "
               f"done; CI queue {rng.randrange(0, 7)} waiting.", 0.3)

    def _service_line(self, rng: random.Random, s: int, c: int, phase: str,
                      pos: int) -> tuple[str, float]:
        name, _, base_rps, base_p95, replicas = _SERVICES[s]
        cluster = _CLUSTERS[c][0]
        profile = _rng(self.seed, "profile", name, cluster)
        share = (1.0, 0.55, 0.04, 0.02)[c]
        rps = max(1, round(base_rps * share * profile.uniform(0.8, 1.2) * rng.uniform(0.9, 1.1)))
        p95 = base_p95 * profile.uniform(0.85, 1.2) * rng.uniform(0.92, 1.08)
        err = profile.uniform(0.01, 0.15) * rng.uniform(0.6, 1.4)
        cpu = profile.uniform(25, 60) * rng.uniform(0.9, 1.1)
        desired = replicas if c < 2 else max(1, replicas // 3)
        if c == 0 and name == "checkout-api":
            factor = {"degraded": 4.7, "rolling_back": 3.6, "recovering": 1.7}.get(phase, 1.0)
            p95 *= factor
            if factor > 1.5:
                err *= 9.0
                cpu *= 1.3
                desired = 9
        if c == 0 and name == "pricing-service":
            if phase in ("degraded", "rolling_back"):
                rps *= 3
                cpu *= 1.5
            if pos >= 3:
                desired = 8
        ready = desired - (1 if rng.random() < 0.08 else 0)
        p99 = p95 * rng.uniform(1.7, 2.4)
        importance = 0.9 if c == 0 and name in _CUSTOMER_FACING[:4] else \
            (0.6 if c == 0 else (0.35 if c == 1 else 0.2))
        return (f"{name}@{cluster}: {ready}/{desired} ready, {rps} rps, p95 {round(p95)} ms, "
                f"p99 {round(p99)} ms, 5xx {err:.2f}%, CPU {round(min(cpu, 99))}%.", importance)


# ---------------------------------------------------------------------------- helpers

def _prompt_lines(lines: _Lines) -> tuple[PromptLine, ...]:
    return tuple(PromptLine(text, importance) for text, importance in lines)


def _clamp(importance: float) -> float:
    return round(min(1.0, max(0.2, importance)), 2)


def _take(stream: Iterator[tuple[str, float]], n: int) -> _Lines:
    out: _Lines = []
    for line in stream:
        if len(out) >= n:
            break
        out.append(line)
    return out


def _estimate_tokens(text: str) -> float:
    """SmolLM2 tokens of a memory line, estimated from its digits, words and punctuation.

    Fitted on the memory corpus (mean error about 3%); digits are one token each in
    SmolLM2, which is why character counts alone estimate poorly.
    """
    digits = sum(c.isdigit() for c in text)
    punct = sum(not c.isalnum() and not c.isspace() for c in text)
    words = len(_WORD.findall(text))
    return 1.27 * digits + 1.06 * words + 0.9 * punct - 0.8


def _fill_tokens(lines: _Lines, budget: int) -> _Lines:
    """The leading lines whose estimated tokens (plus a newline each) fit ``budget``.

    Stops at the first line that does not fit, so the result is a prefix of the
    ranking; always keeps at least one line.
    """
    out: _Lines = []
    used = 0.0
    for text, importance in lines:
        cost = _estimate_tokens(text) + 1.0
        if out and used + cost > budget:
            break
        out.append((text, importance))
        used += cost
    return out


def _diff(prev: dict[str, tuple[PromptLine, ...]],
          cur: dict[str, tuple[PromptLine, ...]]) -> tuple[str, ...]:
    def texts(lines: tuple[PromptLine, ...]) -> list[str]:
        return [line.text for line in lines]

    return tuple(name for name in REPLAY_LAYERS if texts(prev[name]) != texts(cur[name]))
