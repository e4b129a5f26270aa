"""The scheduling core: which queued request goes to Triton next, for many tenants.

Pure and synchronous: no I/O, no clock reads. The shell reads the clock once per
operation and passes ``now``; it calls ``enqueue`` for each admitted request,
``next_batch`` whenever Triton can take a batch, and ``expire`` at ``next_deadline()``.
This docstring is the one place where the algorithm is explained; the code points here.

Pipeline
========
One ``Scheduler`` per endpoint (model). A batch is built by repeating three selectors,
each answering one question (``TierSelector``, ``FairnessPolicy``, ``OrderingPolicy``):

1. *Tier*: which tier goes next? Strictly the highest tier with queued work (paid before
   trial), optionally guarded (below).
2. *Tenant*: which tenant of that tier? Deficit round robin (DRR) with weights, by
   default; the endpoint's config names its policy (``EndpointPolicy.fairness``, one of
   ``FAIRNESS_POLICIES``: ``drr``, ``vtc``: ``vtc.VirtualTokenCounter``, ``fifo``:
   ``fifo.FirstComeFirstServed``, the baseline).
3. *Request*: which of that tenant's requests? (priority, deadline, arrival), in the
   program with the least attained service where its requests name several programs
   (``TenantQueue``; the tenant's share, chosen in 2, is the same however it splits).

until the batch is full (``BatchAssembler``). ``CostModel`` says what each request costs
in DRR units. ``mode="fifo"`` replaces 1-3 by one queue in arrival order: the baseline
and the negative control of the fairness tests.

Order inside a tenant's queue (the tie-breaks)
==============================================
Smallest ``(priority, deadline, seq)`` first: priority level 1 is the highest; among
equal levels the earliest deadline, a request without deadline after every request with
one; among equal deadlines (or none) arrival order (``seq``, unique per scheduler, so no
two requests ever compare equal and the order is total and deterministic). A deadline
never overtakes a level: priority is the client's explicit choice. This order is only
*within* a tenant: DRR decides between tenants regardless of their requests' levels, so
no tenant can buy precedence over another with priority 1.

Tiers
=====
Strict order starves lower tiers while a higher one has work; that is the contract. The
optional guard (``EndpointPolicy.tier_min_share``, ``GuardedTierOrder``) gives tier i a
minimum share s_i of the rows dispatched over a recent window: when tier i has work and
its share of the window is below s_i, it goes before every other tier. The share is
taken from the tiers above it: under overload a paid tier loses up to the sum of the
shares below it, and its latency rises accordingly. Off (empty) by default.

Deficit round robin
===================
Each tier runs in rounds over its tenants with queued work, and each tenant f has a
budget (deficit) D_f. Tenant f's grant is Q_f = quantum * weight_f. Every round grants
each of its tenants Q_f once, at f's first visit in the round (D_f += Q_f); within the
round the tenants take turns (visits), and in a visit f sends its head requests, each paid
from D_f, while the head's cost <= D_f and the visit's slice lasts: about ``weight_f``
requests like its head (at least one), or ``weight_f`` of the quantum's ``visits`` slices
where a slice is more (``visits``: a batch's rows, ``max_batch_size``). Then the next
tenant's visit. When f's head costs more than what is left, f is done with the round,
keeping D_f; the round ends when every tenant of it is done, and the next round visits
them in the order they were done. A model that does not batch has one slice: a visit
lasts until the head does not fit, the classic turn of deficit round robin. When f's
queue empties (dispatch, expiry or cancellation) f leaves and D_f = min(D_f, 0): an idle
tenant saves nothing up, but a debt stays owed. A tenant that (re)joins waits for the
next round with that D_f (0 unless it owes). The state (the round's lists, the current
visit, deficits) lives in ``DrrState``, one per tier; ``DeficitRoundRobin`` is stateless.

Why visits: with a quantum of a full batch and whole-quantum turns, each batch is one
tenant's whenever turns and batches line up, so two backlogged tenants' service moves in
steps of a batch (over a window of a second, half a batch apart on average: 0.027 of the
throughput in ``bench_fairness_time``). Taken a slice at a time, every batch holds each
backlogged tenant's share by weight, and the round's quantum still pays for a request up
to a full batch's cost without saving over several rounds.

Charge-backs. A request's cost may be corrected after it was sent (``charge_back``: the
output tokens of a token-cost endpoint, counted as they come): D_f -= the correction,
whether f is listed or not (an unlisted f's D_f stays <= 0: a refund pays a debt off and
saves nothing). Below 0 D_f is a debt its next grants pay before f sends again; (I1) then
reads D_f >= -(what f was charged back), and the bounds hold with C_f including it. A
tenant whose queue empties between its requests pays for their output on its return, as
one that stayed backlogged does: no way of sending forgives it.

Invariants, for a tenant f of one tier:

(I1) D_f >= 0: a request is sent only if its cost fits in D_f.
(I2) Once f is done with a round, and until its next grant, D_f < cost of f's head <=
     C_f, where C_f is the largest cost of a request f has queued. Between its grant and
     the end of its round D_f < C_f + Q_f.
(I3) A round grants each of its tenants exactly once and ends only when each is done (or
     left), so two tenants backlogged through rounds r..r' are granted once in each; at
     most one visit of a tier is in progress (``DrrState.current``, the head of the
     round's list).
(I4) Batch boundaries are invisible: a batch that ends in the middle of a visit leaves the
     state alone, and the next batch continues that same visit with the remaining
     deficit (no second quantum, no skipped tenant). Tier switches between two picks
     leave a tier's state alone as well. So a tier's sequence of DRR decisions is the
     same as if every batch were one endless batch, and the bounds below hold at every
     single dispatch, not only at batch or round ends.

Fairness bound. Over an interval (t1, t] let g_f be the number of grants f received,
S_f the cost it was sent. Every unit granted is either sent or still in D_f, so
S_f = g_f * Q_f + D_f(t1) - D_f(t), and, dividing by the weight w_f,

    S_f / w_f = g_f * q + (D_f(t1) - D_f(t)) / w_f.

Theorem A (common start). Let tenants A and B of one tier (weights a, b) be
continuously backlogged during (t1, t], both with D = 0 and neither granted in the
current round at t1 (for example: both join an idle tier). Then after every dispatch

    |S_A / a - S_B / b| < q + max(C_A / a, C_B / b).

Proof. By (I3) g_A - g_B is -1, 0 or 1. If g_A = g_B + 1, A was granted in the current
round and B not yet, so B is done with the round before: 0 <= D_B/b < C_B/b, while
0 <= D_A/a < C_A/a + q (I2): the difference q - D_A/a + D_B/b lies in (-C_A/a, q +
C_B/b); symmetrically for g_B = g_A + 1. If g_A = g_B, both D lie in [0, C/w + q): the
difference -D_A/a + D_B/b lies in (-(C_A/a + q), C_B/b + q). QED. With weights 1 and one
largest cost C this is the classic |S_A - S_B| < quantum + C.

Theorem B (any start). Let t1 be the moment the later of the two, A, joined (its queue
went from empty to non-empty); B may then hold up to C_B + Q_B unspent of a grant it had
in the current round. Then, after every dispatch while both stay backlogged,

    -(2q + C_A/a + C_B/b) < S_A/a - S_B/b < q + C_B/b.

Proof. A joins the next round's list. If B was done with the current round at t1 it is
ahead of A in that list, and g_B - g_A is 0 or 1 from then on, with D_B(t1)/b < C_B/b;
if B had not yet been granted in it, B's grant comes after t1 and again g_B - g_A is 0
or 1, D_B(t1)/b < C_B/b; if B had been granted in it, B is done with it after A joined,
so A comes first in every later round and g_A - g_B is 0 or 1, with D_B(t1)/b < C_B/b +
q. In each case bound D_A(t)/a and D_B(t)/b by (I1), (I2): the upper bound is q + C_B/b
throughout, the lower -(q + C_A/a + C_B/b) but in the last case with g_A = g_B, where A
may be in the middle of its round (up to C_A/a + q unspent) while B has spent both its
leftover and its grant: -(2q + C_A/a + C_B/b). An example (``tests/scheduler/
test_scheduler_units.py``): q = 100 in slices of 12.5, B's requests cost 50 (its first
51), A's 1; B, granted and holding 149 when A joins, sends 100 in its round, then 50 a
visit against A's 12 in the next: S_A - S_B reaches -188, past -(q + C_A + C_B) = -152,
within -(2q + C_A + C_B) = -252. The classic turn (one visit a round) keeps the tighter
-(q + C_A/a + C_B/b): A is then never in its turn while B is. The extra quantum is that
transient and does not grow with time. The property tests check theorem B on random
interleavings of enqueue, batches, expiry and cancellation, and theorem A on common
starts.

Requests that cost more than a grant. A head of cost c > Q_f is still served: f saves
D_f over ceil(c / Q_f) rounds (I2 keeps the leftover). Consequences: that request waits
that many rounds, and the requests behind it in f's own queue wait with it (the order
inside a tenant is strict); the long-run share of f is unchanged (the bound holds with
C_f = c, so one expensive request widens the short-term imbalance by its cost). The
defaults keep this rare: quantum = 1 row on request-cost endpoints (a multi-row request
saves for as many rounds as it has rows), a full batch of tokens on token-cost endpoints.

Round jumps. If a round ends with nothing sent (every tenant of it is saving), the next
k - 1 rounds, where k is the fewest further grants any of them needs, would send nothing
either. Instead of walking them, ``DrrState.jumps`` += k - 1 and each tenant adds the
skipped grants, (jumps - seen) * Q_f, lazily at its next grant (or when ``deficits()`` is
read). That is exactly the state the empty rounds would have produced (every tenant done
with each, deficits grown once a round), so (I1)-(I4) and the bounds are unchanged; k is
rounded down on float doubt, which can only cost an extra pass.

Batches
=======
``next_batch`` repeats tier -> tenant -> request and appends the request while the batch
has room: at most ``max_batch_size`` rows and ``max_batch_tokens`` tokens, all with the
same ``shape_key`` as the first. The first request always goes, even if it alone exceeds
a cap (it goes alone). A batch ends when it is full or the next chosen request does not
fit (too many rows or tokens, another shape): that request is not skipped (skipping would
break the order and the DRR accounting) but stays first for the next batch, its tenant
keeping its turn (I4). ``max_batch_size = 0`` (a model that does not batch): one request
per batch. The scheduler is work-conserving: ``next_batch`` returns a non-empty batch
whenever anything is queued.

Deadlines, cancellation and counts
==================================
``expire(now)`` removes every request with deadline <= now (so ``expire(deadline)``
returns it, ``expire(deadline - epsilon)`` does not). ``next_batch(now)`` never dispatches
such a request: it expires them first and keeps them for the next ``expire`` call, and
``next_deadline()`` then returns a past time so the shell calls it at once. Removal from
the indexes is lazy: every index holds a shared handle that removal empties (tombstones
are dropped when reached, or the index is rebuilt once they outnumber live entries), but
every count (per tenant, per tier, per scheduler, process-wide in ``GlobalCaps``) is
updated at once, so at every moment
``admitted == dispatched + expired + cancelled + queued``.

Failover
========
A standby that takes over resumes the fairness state the leader exported
(``Scheduler.export_fairness``, ``resume_fairness``): the deficits and virtual token
counters, exactly, so who was ahead by how much survives the failover. How the carried
backlog joins again, and what that costs the bounds (at most one quantum, once), is in
``fair_frontend.scheduler.snapshot``.

Complexity
==========
n = a tenant's queued requests, d = queued requests with a deadline, T = tiers,
L = priority levels. ``enqueue``: O(log n) for the tenant's heap, plus O(1) for a
deadline pushed in deadline order (one timeout for all: a deque) or O(log d) out of
order (a heap). Each dispatch decision: O(T) to choose the tier, O(1) amortised for DRR
when visits can send (grant >= typical cost; each visit costs O(1) and sends or ends),
O(log n) to pop; never a scan over tenants: the round's list rotates as a deque. A round
in which every tenant is saving costs one pass over its tenants, then a round jump.
``expire``/``cancel``: O(1) amortised plus the lazy pops. ``backlog_ahead``: O(T + L)
from aggregates, plus O(programs with queued work) of the tenant's where it keeps
programs apart and the request names its program. Memory: the request (slots), a
handle, a heap entry, an arrival entry and a deadline entry if it has one, about
0.4-0.5 KB in all (``benchmarks/README.md``).
"""

from __future__ import annotations

from fair_frontend.scheduler.assembly import BatchAssembler
from fair_frontend.scheduler.caps import GlobalCaps, QueueLimits
from fair_frontend.scheduler.core import Mode, Scheduler
from fair_frontend.scheduler.cost import (
    CostModel,
    CostUnit,
    RequestCost,
    TokenCost,
    cost_model_for,
)
from fair_frontend.scheduler.fairness import (
    FAIRNESS_POLICIES,
    DeficitRoundRobin,
    DrrState,
    FairnessFactory,
    FairnessPolicy,
)
from fair_frontend.scheduler.fifo import FifoState, FirstComeFirstServed
from fair_frontend.scheduler.ordering import OrderingPolicy, PriorityDeadlineArrival
from fair_frontend.scheduler.queues import TenantQueue
from fair_frontend.scheduler.snapshot import SchedulerFairness, TierFairness
from fair_frontend.scheduler.tiers import (
    GuardedTierOrder,
    ShareWindow,
    StrictTierOrder,
    Tier,
    TierSelector,
)
from fair_frontend.scheduler.types import (
    DEFAULT_DEBT_CARRIED,
    DEFAULT_TIER_SHARE_WINDOW_ROWS,
    Backlog,
    Counters,
    EndpointPolicy,
    QueuedRequest,
    QueueState,
    TenantDirectory,
    TenantSpec,
    TenantTerms,
)
from fair_frontend.scheduler.vtc import VirtualTokenCounter, VtcState

__all__ = [
    "DEFAULT_DEBT_CARRIED",
    "DEFAULT_TIER_SHARE_WINDOW_ROWS",
    "FAIRNESS_POLICIES",
    "Backlog",
    "BatchAssembler",
    "CostModel",
    "CostUnit",
    "Counters",
    "DeficitRoundRobin",
    "DrrState",
    "EndpointPolicy",
    "FairnessFactory",
    "FairnessPolicy",
    "FifoState",
    "FirstComeFirstServed",
    "GlobalCaps",
    "GuardedTierOrder",
    "Mode",
    "OrderingPolicy",
    "PriorityDeadlineArrival",
    "QueueLimits",
    "QueueState",
    "QueuedRequest",
    "RequestCost",
    "Scheduler",
    "SchedulerFairness",
    "ShareWindow",
    "StrictTierOrder",
    "TenantDirectory",
    "TenantQueue",
    "TenantSpec",
    "TenantTerms",
    "Tier",
    "TierFairness",
    "TierSelector",
    "TokenCost",
    "VirtualTokenCounter",
    "VtcState",
    "cost_model_for",
]
