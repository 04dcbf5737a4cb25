"""Test fixtures for users of vllm-compat: small checkpoints that vLLM loads like the real models."""
