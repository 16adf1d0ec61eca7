"""Two vLLM replicas (CPU build) sharing contextkit's live tier on moto's S3 server over
HTTP, behind vllm-router: a prompt one replica computed loads on the other, tenants
share nothing, KV events say where blocks are, a tampered object and a MAC-valid
malformed one are refused and the turn answered by recompute. Run by ``make test-vllm``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.connector_server import counter, counter_above

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
SERVED = "contextkit-replicas"
KEY = "replicas-test-key"
WORDS = ("alert", "latency", "replica", "deploy", "rollback", "quota", "shard", "region")


def _text(seed: int, words: int = 700) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Events:
    """Every KV event batch the replicas publish (ZMQ SUB, vLLM's msgpack format)."""

    def __init__(self, ports: list[int]) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.socks = []
        for port in ports:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(sock)
        self.events: list[list[dict[str, Any]]] = [[] for _ in ports]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(100):
                _topic, _seq, payload = sock.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                self.events[self.socks.index(sock)].extend(batch[1])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from integrations.vllm.bench.harness import OpenAIServer, free_port
    from integrations.vllm.bench.replicas_bench import (
        AWS_ENV,
        BUCKET,
        MotoS3,
        Router,
        default_router,
    )
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.model import packaged_model_dir

    work = tmp_path_factory.mktemp("replicas")
    s3 = MotoS3(work / "moto.log").start()
    servers, configs, ports = [], [], []
    events = None
    router = None
    try:
        for name in ("a", "b"):
            config = ConnectorConfig(
                block_size=BLOCK, shadow_url="", session_id=f"replica-{name}",
                local_store=f"file://{work / name}", stats_path=str(work / f"{name}.jsonl"),
                host_blocks=600, shared_url=f"s3://{BUCKET}/test",
                shared_endpoint_url=s3.url, shared_chunk_blocks=2)
            port = free_port()
            env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
                   "CONTEXTKIT_SHADOW_KEY": KEY, **AWS_ENV}
            srv = OpenAIServer(str(packaged_model_dir()), config, work / f"server-{name}.log",
                               served_name=SERVED, block_size=BLOCK, max_model_len=2048,
                               extra_args=["--enable-prompt-tokens-details", "--kv-events-config",
                                           json.dumps({"enable_kv_cache_events": True,
                                                       "publisher": "zmq",
                                                       "endpoint": f"tcp://*:{port}"})],
                               env=env)
            srv.start()
            servers.append(srv)
            configs.append(config)
            ports.append(port)
        events = Events(ports)
        router = Router(default_router(), [s.url for s in servers], [None, None],
                        work / "router.log", "consistent_hash").start()
        yield {"servers": servers, "configs": configs, "events": events, "router": router,
               "s3": s3, "work": work}
    finally:
        if events is not None:
            events.close()
        if router is not None:
            router.stop()
        for srv in servers:
            srv.stop()
        s3.stop()


def _chat(url: str, text: str, tenant: str, session: str | None = None) -> dict[str, Any]:
    import urllib.request

    body: dict[str, Any] = {"model": SERVED, "max_tokens": 2, "temperature": 0,
                            "cache_salt": tenant,
                            "messages": [{"role": "system", "content": text},
                                         {"role": "user", "content": "Summarise."}]}
    headers = {"Content-Type": "application/json"}
    if session:
        headers["x-session-id"] = session  # vllm-router's consistent_hash key
    request = urllib.request.Request(url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def _record(config: Any, start: int) -> dict[str, Any]:
    from integrations.vllm.bench.harness import read_stats

    for _ in range(100):
        rows, _ = read_stats(Path(config.stats_path), start)
        if rows:
            return rows[-1]
        time.sleep(0.1)
    raise AssertionError("no connector record")


def _offset(config: Any) -> int:
    path = Path(config.stats_path)
    return path.stat().st_size if path.is_file() else 0


def _wait_uploads(config: Any, n: int) -> list[dict[str, Any]]:
    """The replica's upload records once there are ``n`` or more and no more come."""
    from integrations.vllm.bench.harness import read_events

    seen = -1
    for _ in range(300):
        ups = read_events(Path(config.stats_path), "shared_upload")
        if len(ups) >= n and len(ups) == seen:
            return ups
        seen = len(ups)
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} uploads")


def test_a_prompt_one_replica_computed_loads_on_the_other(cluster: dict[str, Any]) -> None:
    a, b = cluster["servers"]
    ca, cb = cluster["configs"]
    text = _text(1)
    first = _chat(a.url, text, "acme")
    # every whole chunk (2 blocks) of the prompt is uploaded
    ups = _wait_uploads(ca, first["usage"]["prompt_tokens"] // BLOCK // 2)
    assert all(u["lag_s"] >= 0 for u in ups)  # each upload recorded its lag
    start = _offset(cb)
    reply = _chat(b.url, text, "acme")  # B never saw it: the shared tier has it
    record = _record(cb, start)
    prompt = reply["usage"]["prompt_tokens"]
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert record["shared_hit_tokens"] >= (prompt // BLOCK - 2 * 2) * BLOCK  # whole chunks
    assert cached >= record["shared_hit_tokens"] and record["load_failed_tokens"] == 0
    # another tenant, the same text on B: nothing of acme's is shared with it
    start = _offset(cb)
    other = _chat(b.url, text, "globex")
    assert _record(cb, start)["shared_hit_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_events_say_where_the_blocks_are_with_the_tenant_salt(cluster: dict[str, Any]) -> None:
    a, _ = cluster["servers"]
    ca, _ = cluster["configs"]
    n = len(_wait_uploads(ca, 1))
    _chat(a.url, _text(2), "initech")
    _wait_uploads(ca, n + 2)
    time.sleep(2)  # the reports reach the scheduler with the next steps
    _chat(a.url, "tick", "initech")  # one more step carries them
    deadline = time.time() + 30
    while time.time() < deadline:
        ours = [e for e in cluster["events"].events[0]
                if e.get("type") == "BlockStored" and e.get("medium") in ("CPU", "STORAGE")
                and (e.get("extra_keys") or [None])[0] == ["initech"]]
        if {e["medium"] for e in ours} == {"CPU", "STORAGE"}:
            break
        time.sleep(0.5)
    media = {e["medium"]: e for e in ours}
    assert set(media) == {"CPU", "STORAGE"}, [e.get("medium") for e in ours]
    assert media["STORAGE"]["locality"] == "REMOTE"
    assert media["STORAGE"]["ownership"] == "contextkit-shared"
    assert all(e["block_size"] == BLOCK and len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
               for e in ours)


def _new_chunks(cluster: dict[str, Any], text: str, tenant: str) -> list[str]:
    """Replica A serves ``text`` for ``tenant``; the shared tier's new chunk objects,
    once every whole chunk of the prompt is uploaded (sorted by name)."""
    from integrations.vllm.bench.replicas_bench import BUCKET

    a, _ = cluster["servers"]
    ca, _ = cluster["configs"]
    client = cluster["s3"].client()

    def names() -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])}

    before = names()
    n = len(_wait_uploads(ca, 1))
    first = _chat(a.url, text, tenant)
    _wait_uploads(ca, n + first["usage"]["prompt_tokens"] // BLOCK // 2)  # every chunk
    new = sorted(k for k in names() - before if "/t/" in k)
    assert new
    return new


def test_a_tampered_object_is_refused_and_the_turn_recomputed(cluster: dict[str, Any]) -> None:
    from integrations.vllm.bench.replicas_bench import BUCKET

    _, b = cluster["servers"]
    _, cb = cluster["configs"]
    client = cluster["s3"].client()
    text = _text(3)
    new = _new_chunks(cluster, text, "umbrella")
    for key in new:  # one byte of each new chunk's KV
        data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0xFF
        client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    refused = counter(b, "vllm:contextkit_shared_refused_total")
    start = _offset(cb)
    reply = _chat(b.url, text, "umbrella")  # answered all the same
    assert reply["choices"][0]["message"]["content"] is not None
    record = _record(cb, start)
    assert record["external_hit_tokens"] == 0 and record["load_failed_tokens"] > 0
    assert counter_above(b, "vllm:contextkit_shared_refused_total", refused) > refused


def test_a_mac_valid_malformed_object_is_refused_and_the_turn_answered(
        cluster: dict[str, Any]) -> None:
    # a replica on other code (it holds the key) writes chunks whose header lies about
    # the body, or whose body is cut short, each signed: B refuses them, never raises,
    # and answers the turn by recompute
    from integrations.vllm.bench.replicas_bench import BUCKET
    from shadow.shared.objects import assemble_object, split_object

    _, b = cluster["servers"]
    _, cb = cluster["configs"]
    client = cluster["s3"].client()
    text = _text(4)
    for i, key in enumerate(_new_chunks(cluster, text, "wayne")):
        doc, body = split_object(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        if i % 2:
            data = assemble_object(json.dumps(doc).encode(), bytes(body)[:len(body) // 2],
                                   KEY.encode())
        else:  # a tensor's declared shape no longer matches its bytes
            tensor = next(iter(doc["parts"][0]["tensors"].values()))
            tensor["shape"] = [2 * tensor["shape"][0], *tensor["shape"][1:]]
            data = assemble_object(json.dumps(doc).encode(), bytes(body), KEY.encode())
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
    refused = counter(b, "vllm:contextkit_shared_refused_total")
    start = _offset(cb)
    reply = _chat(b.url, text, "wayne")
    assert reply["choices"][0]["message"]["content"] is not None
    record = _record(cb, start)
    # the lookup promised the chunks (it reads no bodies); the load refused every one
    # and vLLM recomputed them
    assert record["external_hit_tokens"] == 0
    assert record["load_failed_tokens"] == record["shared_hit_tokens"] > 0
    assert counter_above(b, "vllm:contextkit_shared_refused_total", refused) > refused
    b.get("/health")  # the server is still up


def test_the_router_keeps_each_session_on_one_replica(cluster: dict[str, Any]) -> None:
    servers = cluster["servers"]
    router = cluster["router"]
    where: dict[str, set[int]] = {}
    for turn in range(2):
        for s in range(10):  # all on one replica by chance: 2 in 1,024
            before = [counter(x, "vllm:request_success_total") for x in servers]
            _chat(router.url, _text(100 + s, 40 + turn), "acme", session=f"agent-{s}")
            after = [counter(x, "vllm:request_success_total") for x in servers]
            (served,) = [j for j, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
            where.setdefault(f"agent-{s}", set()).add(served)
    assert all(len(replicas) == 1 for replicas in where.values()), where
    assert set().union(*where.values()) == {0, 1}, where  # sessions spread over both
