"""``SlotTimes``: how long does a request hold one of an engine's slots?

An engine endpoint (``Endpoint.max_inflight``: continuous batching inside the model, the
shipped ``llm``, Triton's vLLM and TensorRT-LLM backends) serves up to ``max_inflight``
requests at once, each for as long as it generates. What frees a slot for the next
request in line is one of them ending; how often that happens is what the engine
throttle (``fair_frontend.admission.throttle.EngineThrottle``) needs. Each request's hold
time is measured where dispatch already has it: from when its stream to Triton opened to
when it ended (``BatchReport.started`` / ``.finished`` of its one-request "batch"),
whatever the outcome (a failed or cancelled request frees its slot too).

The estimate is the mean hold time H over the recent requests: an exponential moving
average over requests with weight ``max(1/n, alpha)`` for the n-th, so the first few
are averaged plainly and later ones weigh ``alpha``. For an engine of S slots
(``for_slots``): alpha = 1 / (2 S), a memory of about two turnovers of the slots (the
mean of ~2S hold times of coefficient of variation CV is off by about CV / sqrt(4S):
6 % for S = 16 and CV 0.5), and no data before S requests have ended. Why wait a
turnover: after a cold start the first requests to end are the shortest of those that
started together, so the first few hold times underestimate H (measured in the
throttle's simulation: 0.62 for a true 1.0 after 16 of them). Over requests, not time:
hold times are long (seconds) and arrive in bursts, and a time-aware decay would forget
an idle engine's last measurements. H includes everything that lengthens a slot's hold
in practice: the engine's step time at its current load (a step slows as more sequences
run), the tokens tenants ask for lately, streams paused by clients that do not read.

Pure: ``observe`` takes the measurement; nothing here reads a clock.
"""

from __future__ import annotations

import math

DEFAULT_SLOT_ALPHA = 0.05
"""Weight of the newest request's hold time once enough have been seen."""

DEFAULT_MIN_SLOT_SAMPLES = 4
"""Requests measured before the estimate counts as data (the throttle never rejects
before)."""


class SlotTimes:
    """How long does a request hold one of this engine's slots (mean, lately)?"""

    def __init__(
        self,
        alpha: float = DEFAULT_SLOT_ALPHA,
        min_samples: int = DEFAULT_MIN_SLOT_SAMPLES,
    ) -> None:
        if not 0 < alpha <= 1 or min_samples < 1:
            raise ValueError("need 0 < alpha <= 1 and min_samples >= 1")
        self.alpha = alpha
        self.min_samples = min_samples
        self.samples = 0
        self._mean = 0.0

    @classmethod
    def for_slots(cls, slots: int) -> SlotTimes:
        """The estimate for an engine of ``slots`` slots (the module docstring's choice)."""
        return cls(alpha=min(1.0, 1.0 / (2 * slots)), min_samples=max(1, slots))

    def observe(self, seconds: float) -> None:
        """A request left its slot after holding it ``seconds``."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self.samples += 1
        weight = max(1.0 / self.samples, self.alpha)
        self._mean += (seconds - self._mean) * weight

    @property
    def has_data(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def mean_hold_s(self) -> float:
        """The mean hold time lately (0 before any measurement)."""
        return self._mean
