"""dlite-trt: compile a Qwen3 target and a DLite draft into one speculative-decoding engine."""

__version__ = "0.1.0"
