"""contextkit: context middleware that gives agents semantic control of the KV cache.

The layered prompt builder, cache-aware pipeline, engine and tier manager live
here; the cache itself is :mod:`gpu_cache`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
