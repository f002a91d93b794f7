"""Load generation and capacity planning for OpenAI-compatible embedding servers.

Installed as ``coalesce.loadtests``; ``coalesce loadtest`` and ``coalesce plan`` dispatch to
:mod:`coalesce.loadtests.cli`. Nothing in this package imports torch or the service at module level:
the generator must start fast and leave the CPU to the server it measures.
"""
