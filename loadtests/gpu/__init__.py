"""The one-call GPU check and what a GPU session carries: ``check`` (correctness, latency, capture cost,
service throughput), ``bundle`` (the wheels and model files a lent GPU machine lacks), ``service_load``
(its standard-library load client). They measure the execution engine in ``coalesce.kernels``; nothing
here is imported by the service. ``kernels/gpu_session.sh`` runs them on the GPU machine.
"""
