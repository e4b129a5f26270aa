"""Everything said to Triton, in one package.

- ``forwarder``: the gRPC client (unary and decoupled streams), with deadlines and the
  streams' watchdog;
- ``http``: the HTTP side doors (model control, statistics, shared memory) and the
  generate extension's upstream;
- ``upstream``: one classification of what Triton answers into the frontend's errors;
- ``metrics``: the scrape of Triton's Prometheus endpoint that feeds cost and capacity;
- ``sse``: the generate extension's events, passed on as bytes (the model's error event
  read here);
- ``model_config``: a model's description (``ModelInfo``) from Triton's model config;
- ``embedded``: a real ``tritonserver`` run as a child process (``fair-frontend up``, the
  tests).

Nothing here decides anything: the core and the shells own the policy and call in.
"""
