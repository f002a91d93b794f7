"""Execution engines: the model runners the batcher drives, and the one thread that owns the device.

Installed as ``coalesce.kernels``. This file imports nothing on purpose: ``transformers`` imports any
importable top-level ``kernels`` while it starts, and an empty package keeps that probe harmless.
"""
