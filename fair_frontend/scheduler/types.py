"""The scheduler's data: queued requests, the endpoint's policy, tenants, and its answers.

Plain data, no behaviour beyond validation; the algorithm lives in the modules that use it
and is explained once in the package docstring.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fair_frontend.scheduler.cost import CostUnit

if TYPE_CHECKING:
    from fair_frontend.scheduler.queues import TenantQueue

DEFAULT_TIER_SHARE_WINDOW_ROWS = 1000
"""Rows in the recent window over which the tier guard measures each tier's share."""

DEFAULT_DEBT_CARRIED = 2.0
"""VTC: what a tenant whose queue fills again keeps of its debt, in turnovers of the
engine's slots (``vtc``'s lift)."""


class QueueState(enum.Enum):
    """Where a request is in the scheduler's hands.

    The terminal states map onto ``fair_frontend.outcomes.Outcome``: ``EXPIRED`` and
    ``CANCELLED`` one to one; ``DISPATCHED`` only means "handed to the shell", which
    records ``Outcome.DISPATCHED`` or ``Outcome.FAILED`` once Triton answers.
    """

    NEW = "new"  # built, not yet enqueued
    QUEUED = "queued"
    DISPATCHED = "dispatched"  # returned in a batch by next_batch
    EXPIRED = "expired"  # its deadline passed while queued
    CANCELLED = "cancelled"  # removed by cancel() before dispatch


Handle = list["QueuedRequest | None"]
"""A one-item list shared by every index entry of one queued request.

Heaps and deques hold the handle, not the request; leaving the queue sets ``handle[0] =
None``, which turns every entry into a tombstone at once and drops the index's reference to
the request (and what it carries) immediately, however late the tombstone itself is popped.
"""


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """One client request: possibly several batch rows, always dispatched whole.

    The fields the scheduler reads and keeps. What else a request carries (its tensors,
    where its answer goes) is a subclass's: ``fair_frontend.core.dispatch.CoreRequest``.
    """

    tenant: str
    rows: int  # batch rows it occupies, >= 1
    tokens: int  # its token count (max_batch_tokens, token cost), >= 0
    nbytes: int  # payload bytes (byte caps), >= 0
    priority: int  # effective level, 1 = highest
    deadline: float | None  # absolute, on the scheduler's clock; None = none
    shape_key: Hashable = None  # only requests with equal keys share a batch
    # Its program inside its tenant (an agent's run, a chat session; "" none named): the
    # tenant's programs share its turns by least attained service (``TenantQueue``).
    program: str = ""
    # Set by the scheduler at enqueue:
    arrival: float = field(default=0.0, init=False)
    seq: int = field(default=-1, init=False)  # arrival order within one scheduler
    cost: float = field(default=0.0, init=False)  # DRR cost, fixed at enqueue
    state: QueueState = field(default=QueueState.NEW, init=False)
    left_at: float | None = field(default=None, init=False)  # when it left the queue
    _handle: Handle | None = field(default=None, init=False, repr=False)
    _queue: TenantQueue | None = field(default=None, init=False, repr=False)


class Load:
    """Queued work: requests, rows, tokens, bytes and DRR cost, kept exact.

    Updated only by ``TenantQueue.add``/``remove``, for a tenant, a priority level of
    it, and its tier at once (a tenant's program's, where its queue keeps programs
    apart: by ``push`` and ``remove``).
    """

    __slots__ = ("cost", "nbytes", "requests", "rows", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.rows = 0
        self.tokens = 0
        self.nbytes = 0
        self.cost = 0.0


@dataclass(frozen=True, slots=True)
class Backlog:
    """Work expected to be served before (and including) a new request."""

    rows: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Counters:
    """A snapshot of one scheduler's request counts since it was built.

    Invariant at every moment: ``admitted == dispatched + expired + cancelled + queued``.
    """

    admitted: int
    dispatched: int
    expired: int
    cancelled: int


class TenantTerms(Protocol):
    """What the scheduler reads of a tenant (the config's ``Tenant`` has it)."""

    @property
    def tier(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def max_queued(self) -> int | None: ...

    @property
    def max_queued_bytes(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant's scheduling terms, for callers without a config (tests, benchmarks)."""

    tier: str
    weight: float = 1.0
    max_queued: int | None = None  # None: the endpoint's default (GlobalCaps)
    max_queued_bytes: int | None = None  # None: the process-wide default share


TenantDirectory = Mapping[str, TenantTerms]
"""Tenant name -> its terms. ``Config.tenants`` is one; so is a dict of ``TenantSpec``."""


@dataclass(frozen=True)
class EndpointPolicy:
    """How one endpoint (model) schedules: part of the endpoint's plan, built from the
    config and the model's description (``fair_frontend.endpoint.plan``)."""

    cost: CostUnit
    max_batch_size: int  # rows per batch; 0: the model does not batch (one request each)
    max_batch_tokens: int | None  # tokens per batch; None: no token cap
    quantum: float | None  # DRR budget per round before weight; None: a full batch, learned
    tiers: tuple[str, ...]  # highest first
    tier_min_share: Mapping[str, float] = field(default_factory=dict)  # empty: guard off
    share_window_rows: int = DEFAULT_TIER_SHARE_WINDOW_ROWS
    # Engine mode: the engine's slots (max_inflight), which size a tenant's default queue
    # cap (GlobalCaps.default_max_queued); None: a batching endpoint.
    slots: int | None = None
    # Selector 2, by its name in ``fairness.FAIRNESS_POLICIES``: how the tenants of one tier
    # share the endpoint.
    fairness: str = "drr"
    # VTC: turnovers of the engine's slots of debt a tenant keeps when its queue fills
    # again (``vtc``'s lift).
    debt_carried: float = DEFAULT_DEBT_CARRIED

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch_size < 0:
            problems.append(f"max_batch_size {self.max_batch_size} < 0")
        if self.max_batch_tokens is not None and self.max_batch_tokens <= 0:
            problems.append(f"max_batch_tokens {self.max_batch_tokens} <= 0")
        if self.quantum is not None and not (self.quantum > 0 and math.isfinite(self.quantum)):
            problems.append(f"quantum {self.quantum} is not a positive number")
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            problems.append(f"tiers {self.tiers} must be non-empty and distinct")
        for tier, share in self.tier_min_share.items():
            if tier not in self.tiers:
                problems.append(f"tier_min_share: unknown tier {tier!r}")
            if not 0 <= share < 1:
                problems.append(f"tier_min_share[{tier!r}] = {share} is not in [0, 1)")
        if sum(self.tier_min_share.values()) >= 1:
            problems.append("tier_min_share: shares must add up to less than 1")
        if self.share_window_rows < 1:
            problems.append(f"share_window_rows {self.share_window_rows} < 1")
        if self.slots is not None and self.slots < 1:
            problems.append(f"slots {self.slots} < 1")
        if not (self.debt_carried >= 0 and math.isfinite(self.debt_carried)):
            problems.append(f"debt_carried {self.debt_carried} is not a number >= 0")
        if problems:
            raise ValueError("invalid endpoint policy: " + "; ".join(problems))
