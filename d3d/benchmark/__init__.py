"""Measuring decoding methods side by side: throughput, acceptance length, cache hits and losslessness."""
