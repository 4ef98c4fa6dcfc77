"""A small speculative-decoding workload built on the torch-only core."""
