"""Evaluation of frozen encoders: the fixed kNN / linear-probe / semi-supervised protocol (protocol),
encoder checkpoints (checkpoint) and the ``fedssl-eval`` command line (cli)."""
