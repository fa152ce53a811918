"""`dlite-trt bench`: workloads, methods side by side, metrics and reports."""
