"""vllm-ddtree: DDTree speculative decoding for vLLM 0.26.0 (DFlash drafter, best-first draft trees, tree verify)."""

__version__ = "0.1.0"
