"""The LowRankRecurrence plugin: the DLite sequential head as one kernel (see README.md)."""
