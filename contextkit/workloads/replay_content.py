"""Content of the agent replay (:mod:`~contextkit.workloads.replay`): vocabulary, script, layers.

The tables and small helpers the replay's generators draw from: the platform's
services and people, the 20-message script with its topics and memory queries, the
byte-stable layers (axioms, identity, system knowledge, capabilities, affect, the
awareness base), the neuron seeds, sizing constants and the token estimate used to
fill the memories layer. Memory templates live in :mod:`contextkit.workloads.replay_memories`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

from contextkit.prompt.layers import LayerConfig
from contextkit.prompt.markup import PromptLine

Lines = list[tuple[str, float]]
_WORD = re.compile(r"[A-Za-z]+")

# ---------------------------------------------------------------------------- vocabulary

_CET = timezone(timedelta(hours=1), "CET")
SESSION_DAY = datetime(2025, 3, 11, 17, 2, 0, tzinfo=_CET)  # a Tuesday
HANDOFF = datetime(2025, 3, 11, 18, 0, 0, tzinfo=_CET)  # also the end of business hours

# name, owning team, base requests/s, base p95 ms, replicas
SERVICES: tuple[tuple[str, str, int, int, int], ...] = (
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
SERVICE_NAMES = tuple(s[0] for s in SERVICES)
CUSTOMER_FACING = ("checkout-api", "cart-service", "payments-gateway", "web-frontend",
                    "catalog-api", "search-api", "pricing-service")
CLUSTERS: tuple[tuple[str, str], ...] = (
    ("prod-eu", "eu-west-1"), ("prod-us", "us-east-1"), ("staging-eu", "eu-west-1"),
    ("batch-eu", "eu-west-1"),
)
PEOPLE = ("Priya Raman", "Jonas Weber", "Marco Silva", "Aisha Okafor", "Tom Becker")

# ---------------------------------------------------------------------------- script

# (topic, user message, incident phase); phases drive the platform snapshot
SCRIPT: tuple[tuple[str, str, str], ...] = (
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
TOPIC_QUERIES: dict[str, str] = {
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
RELATED: dict[str, tuple[str, ...]] = {
    "latency": ("deploy",),
    "deploy": ("latency", "rollback"),
    "rollback": ("deploy", "incident"),
    "incident": ("rollback", "latency"),
    "cost": ("capacity",),
    "capacity": ("cost", "latency"),
}

# ---------------------------------------------------------------------------- stable layers

AXIOMS: Lines = [
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

IDENTITY: Lines = [
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

SYSTEM_KNOWLEDGE: Lines = [
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

CAPABILITIES: Lines = [
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

AFFECT: Lines = [
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

AWARENESS_BASE: Lines = [
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

NEURONS_CORE: tuple[tuple[str, float, int], ...] = (
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
SYMPTOMS: tuple[tuple[str, str], ...] = (
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
DEPLOY_SIGNS: tuple[tuple[str, str], ...] = (
    ("p95 up more than 20% within 10 minutes", "a new synchronous downstream call"),
    ("error rate up but only on one route", "a changed request schema or validation rule"),
    ("memory climbing steadily", "a cache without a size bound"),
    ("readiness failures on new pods", "a config key missing in one cluster"),
    ("log volume doubling", "a debug log level left on"),
)


def confidence_importance(confidence: float) -> float:
    return round(min(1.0, max(0.2, (confidence - 0.45) / 0.5)), 2)


# ---------------------------------------------------------------------------- sizing

# at scale=1: line counts of the generated layers and the memories' token allowance,
# calibrated so each layer lands at 80-95% of its default budget (SmolLM2 tokens)
BASE_NEURON_LINES = 38
BASE_STATE_LINES = 18
BASE_MEMORY_TOKENS = 990  # estimated with estimate_tokens
BASE_AWARENESS_LINES = len(AWARENESS_BASE)
_EXPANDABLE = ("system_state", "neurons", "memories", "awareness")


def seeded_rng(seed: int, *parts: object) -> random.Random:
    """A generator seeded from a string (SHA-512 based; PYTHONHASHSEED does not matter)."""
    return random.Random(":".join(str(p) for p in ("contextkit-replay", seed, *parts)))


def multipliers(scale: float) -> dict[str, float]:
    """Content multiplier per expandable layer so the prompt grows about ``scale``-fold."""
    config = LayerConfig()
    out: dict[str, float] = {}
    for name in _EXPANDABLE:
        spec = config.get(name)
        headroom = spec.expanded_budget / spec.budget - 1.0
        out[name] = scale if scale < 1.0 else 1.0 + (scale - 1.0) * headroom / 2.0
    return out


def random_date(rng: random.Random) -> str:
    day = datetime(2024, 1, 8) + timedelta(days=rng.randrange(0, 420))
    return day.strftime("%Y-%m-%d")


# ---------------------------------------------------------------------------- helpers

def prompt_lines(lines: Lines) -> tuple[PromptLine, ...]:
    return tuple(PromptLine(text, importance) for text, importance in lines)


def clamp_importance(importance: float) -> float:
    return round(min(1.0, max(0.2, importance)), 2)


def take_lines(stream: Iterator[tuple[str, float]], n: int) -> Lines:
    out: Lines = []
    for line in stream:
        if len(out) >= n:
            break
        out.append(line)
    return out


def estimate_tokens(text: str) -> float:
    """SmolLM2 tokens of a memory line, estimated from its digits, words and punctuation.

    Fitted on the memory corpus (mean error about 3%); digits are one token each in
    SmolLM2, which is why character counts alone estimate poorly.
    """
    digits = sum(c.isdigit() for c in text)
    punct = sum(not c.isalnum() and not c.isspace() for c in text)
    words = len(_WORD.findall(text))
    return 1.27 * digits + 1.06 * words + 0.9 * punct - 0.8


def fill_tokens(lines: Lines, budget: int) -> Lines:
    """The leading lines whose estimated tokens (plus a newline each) fit ``budget``.

    Stops at the first line that does not fit, so the result is a prefix of the
    ranking; always keeps at least one line.
    """
    out: Lines = []
    used = 0.0
    for text, importance in lines:
        cost = estimate_tokens(text) + 1.0
        if out and used + cost > budget:
            break
        out.append((text, importance))
        used += cost
    return out
