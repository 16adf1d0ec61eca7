"""gpu_cache."""
