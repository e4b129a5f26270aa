"""What the frontend tells of what happened, on both sides of the link: the observers'
protocol (``observe``: the core's metrics, statistics and request log hear each event
through it), the logs (``logs``: JSON lines, and the request log, written by a shell or by
the core) and the request traces (``tracing``: spans recorded by the shells and the core).

Below the shells and the core, as ``wire`` is: each side imports these modules, and
they import neither side.
"""
