"""fair_frontend: a multi-tenant fair scheduler for LLM inference in front of Triton.

It speaks Triton's own protocol (KServe v2 over HTTP and gRPC) and puts every request
through admission, tier, deficit round robin and priority before batching it to Triton.
See README.md for the design and ``fair_frontend.scheduler`` for the algorithm.
"""

__version__ = "0.1.0"
