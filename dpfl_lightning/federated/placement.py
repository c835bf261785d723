"""Which rank trains which client of a round (and how many cores a process may use).

A round lasts as long as its busiest rank. Placing clients by id (``client % ranks``) leaves the
ranks unevenly loaded: a uniform cohort of 50 of 1000 clients puts 28 on the busier of two ranks on
average, where 25 is the even share (11% longer rounds). So, when no plugin keeps per-client state,
every rank computes the same balanced placement from the round's public plan: each client's work
is its local steps, and the clients go, most work first, to the least loaded rank (longest
processing time first; with equal work this deals the cohort out in turn, at most one client apart).
Placement does not change the model: every client's randomness is keyed by (seed, round, client), and
the exact aggregation does not depend on which rank adds what. What is summed in floating point
instead can differ in its last bits between placements (and rank counts): the aggregation with
``exact_aggregation=False``, the merged training metrics, and the vectorised executor's batched
kernels where they do not compute every client's slice independently.

Plugins that keep state in ``client.state`` across rounds (SCAFFOLD's ``c_i``, ScaffNew's ``h_i``)
declare ``keeps_client_state = True``; a client then always trains on rank ``client % ranks``, where
its state lives.
"""

from __future__ import annotations

import os

import heapq
from typing import Sequence


def owner(client: int, ranks: int) -> int:
    """The rank that keeps ``client``'s state (and trains it when state is kept)."""
    return client % ranks


def balanced(cohort: Sequence[int], work: Sequence[int], ranks: int) -> list[list[int]]:
    """Every rank's clients (in cohort order), balancing the summed ``work`` (longest first; ties
    keep cohort order and go to the lowest rank). A function of its arguments alone."""
    if ranks == 1:
        return [list(cohort)]
    if not cohort or min(work) == max(work):  # equal work: deal the cohort out in turn
        return [list(cohort[r::ranks]) for r in range(ranks)]
    load = [(0, r) for r in range(ranks)]
    picked: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(cohort)), key=lambda i: -work[i]):  # sorted() is stable
        w, r = heapq.heappop(load)
        picked[r].append(i)
        heapq.heappush(load, (w + work[i], r))
    return [[cohort[i] for i in sorted(mine)] for mine in picked]


def available_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
