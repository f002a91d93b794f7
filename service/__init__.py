"""Coalesce: an embedding micro-batching service. Installed as ``coalesce.service``."""
