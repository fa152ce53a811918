"""Serving an engine from NVIDIA Triton Inference Server (Python backend)."""
