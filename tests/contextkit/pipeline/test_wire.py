"""The wire format between the pipeline and the vLLM connector: one definition
(contextkit.pipeline.served.wire), the same bytes as the JSON lists it always was."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest

from contextkit.pipeline.served.wire import (
    PARAMS_KEY,
    WireSpan,
    decode_fingerprint,
    decode_precision,
    decode_spans,
    encode_labels,
    labels_entry,
    prompt_fingerprint,
)

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("sent", [
    [0, 4, "axioms", 1.0, True],
    [4, 9, "user_turn", 0.3, False],
    [9, 12, "rules", 0.9],  # without the pinned flag: the request's ``pin`` decides
], ids=["pinned", "unpinned", "no-flag"])
def test_a_span_decodes_and_encodes_to_the_same_json(sent: list[object]) -> None:
    span = WireSpan.decode(sent)
    assert (span.start, span.end, span.source_layer) == tuple(sent[:3])
    assert span.pinned is (sent[4] if len(sent) > 4 else None)
    assert json.dumps(span.encode()) == json.dumps(sent)


@pytest.mark.parametrize("sent", [[0, 4, "axioms"], "junk", [0, "x", "axioms", 1.0], 7],
                         ids=["three-values", "a-string", "a-bad-end", "not-a-list"])
def test_a_malformed_span_raises(sent: object) -> None:
    with pytest.raises((TypeError, ValueError, IndexError)):
        WireSpan.decode(sent)  # type: ignore[arg-type]


def test_the_labels_are_keyed_and_fingerprinted() -> None:
    spans = [WireSpan(0, 4, "axioms", 1.0, True), WireSpan(4, 8, "user_turn", 0.3, False)]
    params = encode_labels(spans, pin=True, prompt_token_ids=IDS)
    assert PARAMS_KEY == "contextkit"
    assert params == {"contextkit": {
        "spans": [[0, 4, "axioms", 1.0, True], [4, 8, "user_turn", 0.3, False]],
        "pin": True, "prompt_tokens": len(IDS),
        "prompt_sha256": hashlib.sha256(struct.pack(f"<{len(IDS)}i", *IDS)).hexdigest()}}
    assert list(params["contextkit"]) == ["spans", "pin", "prompt_tokens", "prompt_sha256"]
    assert prompt_fingerprint(IDS) == (len(IDS), params["contextkit"]["prompt_sha256"])
    # read back as the connector reads it
    entry = labels_entry({"other": {}, **params})
    assert decode_spans(entry) == (True, spans)
    assert decode_fingerprint(entry) == prompt_fingerprint(IDS)
    assert decode_precision(entry) is None
    with_keys = encode_labels(spans, pin=False, precision={"default": "int8"})[PARAMS_KEY]
    assert "prompt_tokens" not in with_keys
    assert decode_precision(with_keys) == {"default": "int8"}
    assert labels_entry(None) is None and labels_entry([("contextkit", 1)]) is None


def test_the_wire_module_imports_nothing_heavy() -> None:
    code = ("import sys, contextkit.pipeline.served.wire; print(sorted(m for m in ("
            "'torch', 'transformers', 'numpy', 'gpu_cache', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
