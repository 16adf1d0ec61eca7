"""Test-session environment, set before any test module imports triton or transformers."""

import os

import torch

if not torch.cuda.is_available():
    # Triton reads this when it is first imported: run kernels on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
