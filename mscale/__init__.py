"""MegaScale-Omni: observability and self-healing for multimodal LLM training.

Importing `mscale` has no side effects; the hook library's public API is re-exported here
lazily so that the agent never imports torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
