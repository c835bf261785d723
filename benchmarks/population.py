"""Populations of a million clients: milliseconds per round for sampling a cohort of 1000 and for
the privacy ledger's per-client bookkeeping, and the cost of planning every participation of a run
(calibration of local noise). The cost must grow with the cohort, not with the population.

    python benchmarks/population.py [--clients 1000000] [--cohort 1000] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins.contexts import SetupContext
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.privacy.planning import PrivacyPlanner
from dpfl_lightning.rng import RandomSource
from dpfl_lightning.federated.sampling import ClientSampler


def ms(fn, repeats: int) -> float:
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=10**6)
    ap.add_argument("--cohort", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    M, m = args.clients, args.cohort
    random = RandomSource(0)
    print(f"{M} clients, cohort {m}: median milliseconds per round")
    for sampler in (ClientSampler("uniform", M, m), ClientSampler("poisson", M, rate=m / M)):
        print(f"  sample a {sampler.kind} cohort: {ms(lambda r: sampler.sample(random, r), 50):8.3f}")
    sampler = ClientSampler("poisson", M, rate=m / M)
    planner = PrivacyPlanner(sampler.accounted(), args.rounds, lambda rounds: sampler.participation_counts(random, rounds),
                             lambda n: 1, None)
    # the trainer's own set-up context (no module: planning only), so that the benchmark follows its fields
    ctx = SetupContext(module=None, data=SimpleNamespace(num_clients=M), sampler=sampler, plan=RoundPlan(0, ()),
                       rounds=args.rounds, random=random, privacy=planner,
                       mechanisms=[Mechanism.gaussian("noise", 1.0, 1.0, "local", ("update",))])
    ledger = PrivacyLedger(delta=1e-8)
    t0 = time.perf_counter()
    ledger.setup(ctx=ctx)
    setup = time.perf_counter() - t0
    server = SimpleNamespace(stop=lambda reason: None, next_plan=None)

    def one_round(r: int) -> None:
        plan = RoundPlan(r, tuple(sampler.sample(random, r)))
        ledger.before_round(plan=plan, server=server)
        ledger.on_round_end(server=server, metrics={})

    per_round = ms(one_round, 50)
    print(f"  sample + ledger (per-client local-DP accounting): {per_round:8.3f}   (ledger set-up {setup * 1e3:.0f} ms)")
    t0 = time.perf_counter()
    planner.counts(args.rounds)
    print(f"planning every participation of {args.rounds} rounds (calibration): {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
