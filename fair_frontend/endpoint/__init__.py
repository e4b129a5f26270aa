"""An endpoint's plan: the config and the model's description, resolved once
(``plan.plan``)."""

from fair_frontend.endpoint.plan import EndpointPlan, plan

__all__ = ["EndpointPlan", "plan"]
