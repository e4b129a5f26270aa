"""The core: policy over every request, in one process.

Shells (``fair_frontend.shell``) decode, identify and validate requests and hand the core
one ``Call`` record each (``fair_frontend.wire.records``). The core owns what must be exact
across all of them: admission (the throttle, in-memory rate limits), each model's
scheduler (``fair_frontend.scheduler``: tier, deficit round robin, priority), batch
assembly and dispatch to Triton, the feedback loop (``fair_frontend.feedback``), the
statistics and the metrics. It answers every call exactly once, along the call's route.

``service.Core`` is the entry point; a ``dispatch.Dispatcher`` feeds one model's work to
Triton, in one of the modes of ``dispatch.DISPATCH_MODES``, by the name its plan gives
(``fair_frontend.endpoint``: ``EndpointPlan.mode``): ``batches.BatchDispatcher`` (batches
assembled here), ``granted.GrantedDispatcher`` (batches formed here, their rows sent by
the shells that hold them) or ``engine.EngineDispatcher`` (a model that batches inside
itself: a request per slot);
``admission.EndpointAdmission`` is one endpoint's throttle with the estimates it reads;
``accounting.Accounting`` counts each request against its rate limits and fair share and
records its outcome; ``plan`` turns the config into the policy packages' own parameters.
"""

from __future__ import annotations

from fair_frontend.core.admission import EndpointAdmission, TierShares
from fair_frontend.core.batches import BatchDispatcher
from fair_frontend.core.dispatch import DISPATCH_MODES, Backend, CoreRequest, Dispatcher, Route
from fair_frontend.core.engine import EngineDispatcher
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.core.service import Core, ModelRegistry
from fair_frontend.observability.observe import BatchReport

__all__ = [
    "DISPATCH_MODES",
    "Backend",
    "BatchDispatcher",
    "BatchReport",
    "Core",
    "CoreRequest",
    "Dispatcher",
    "EndpointAdmission",
    "EngineDispatcher",
    "GrantedDispatcher",
    "ModelRegistry",
    "Route",
    "TierShares",
]
