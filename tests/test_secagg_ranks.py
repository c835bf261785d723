"""SecAgg between ranks: each rank holds the secrets of its own clients only, the shares reach their
holders' ranks only, every rank unmasks the survivors' sum bit for bit; a secure run writes none of
its clients' secrets. Ranks are threads of one process here (the MPI run is tests/mpi/test_discrete_ranks.py);
expected sums are computed with Python integers."""

from __future__ import annotations

import threading

import pytest
import torch

from dpfl_lightning import rng
from dpfl_lightning.comm import secagg
from dpfl_lightning.comm.secagg import SecAggRound, mod_sum
from dpfl_lightning.federated.secure_sum import IntegerSumRound, IntegerSumSettings
from dpfl_lightning.plugins import DiscreteDistributedNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, record_client_secrets, tiny_data


class ThreadRanks:
    """``size`` ranks as threads that meet at a barrier for each collective; records what the
    all-to-all delivered to each rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._slots: list = [None] * size
        self.delivered: list[list] = [[] for _ in range(size)]

    def _meet(self, rank: int, obj):
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def allgather(self, rank: int):
        return lambda obj: self._meet(rank, obj)

    def alltoall(self, rank: int):
        def alltoall(objs):
            assert len(objs) == self.size
            out = [objs_of[rank] for objs_of in self._meet(rank, list(objs))]
            self.delivered[rank] += [m for part in out for m in part]
            return out
        return alltoall

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank at once; the ranks' results (an error on any rank is raised)."""
        results, errors = [None] * self.size, []

        def target(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results


def rows_for(cohort, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {c: torch.randint(-(2**40), 2**40, (d,), generator=g, dtype=torch.int64) for c in cohort}


def expected_sum(rows, clients, bits):
    cols = zip(*[rows[c].tolist() for c in clients])
    return torch.tensor([sum(col) % (1 << bits) for col in cols], dtype=torch.int64)


def masked_rounds(ranks, cohort, bits, d, round_idx, src, mine, rows, masked_clients=None, **round_kw):
    """Each rank's SecAggRound after the ranks' exchange, and the masked rows of ``masked_clients``
    (default: every client), each masked on the rank that trains it."""
    masked_clients = set(cohort if masked_clients is None else masked_clients)

    def setup(rank):
        r = SecAggRound(cohort, bits, d, round_idx, src, local_clients=mine[rank], **round_kw)
        r.exchange(ranks.allgather(rank), ranks.alltoall(rank))
        return r, {c: r.mask(c, rows[c]) for c in mine[rank] if c in masked_clients}

    rounds_and_rows = ranks.run(setup)
    return [r for r, _ in rounds_and_rows], {c: row for _, part in rounds_and_rows for c, row in part.items()}


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("neighbours", [None, 4])
def test_each_rank_holds_its_clients_secrets_and_all_unmask_the_survivors_sum(secure, neighbours):
    cohort, d, bits, size = list(range(3, 14)), 24, 20, 3
    src = rng.RandomSource(5, rng.new_secret() if secure else None)
    mine = [cohort[r::size] for r in range(size)]
    dropped = [4, 9]
    survivors = [c for c in cohort if c not in dropped]
    rows = rows_for(cohort, d)
    ranks = ThreadRanks(size)

    rounds, masked = masked_rounds(ranks, cohort, bits, d, 2, src, mine, rows, survivors, neighbours=neighbours)
    for rank, r in enumerate(rounds):
        assert r.local_clients == tuple(mine[rank])
        other = mine[(rank + 1) % size][0]
        with pytest.raises(KeyError, match="not on this rank"):
            r.client_secrets(other)
        # the shares a rank received are exactly those its clients hold, from every owner
        got = sorted((m.owner, m.holder) for m in ranks.delivered[rank])
        assert got == sorted((u, h) for u in cohort for h in r.graph.holders(u) if h in mine[rank])
    total = mod_sum(torch.stack([masked[c] for c in survivors]), bits)
    sums = ranks.run(lambda rank: rounds[rank].unmask(
        total, survivors, dropped, rounds[rank].gather_reveals(survivors, dropped, ranks.allgather(rank))))
    for s in sums:
        assert torch.equal(s, expected_sum(rows, survivors, bits))
    if not secure:  # keyed by (seed, round, client): the same masked rows as one process holding everyone
        alone = SecAggRound(cohort, bits, d, 2, src, neighbours=neighbours)
        assert all(torch.equal(alone.mask(c, rows[c]), masked[c]) for c in survivors)


@pytest.mark.parametrize("secure", [False, True])
def test_a_second_unmasking_request_is_refused_on_every_rank(secure):
    """The double-unmasking attack (Bonawitz et al. 2017, Round 4) through the ranks' exchange: the
    round is unmasked with client 5 dropped; asked again with 5 alive, every rank refuses."""
    cohort, d, bits, size = list(range(9)), 8, 20, 3
    src = rng.RandomSource(2, rng.new_secret() if secure else None)
    mine = [cohort[r::size] for r in range(size)]
    rows = rows_for(cohort, d, seed=5)
    survivors, dropped = [c for c in cohort if c != 5], [5]
    ranks = ThreadRanks(size)

    rounds, masked = masked_rounds(ranks, cohort, bits, d, 1, src, mine, rows, neighbours=4)
    total = mod_sum(torch.stack([masked[c] for c in survivors]), bits)
    first = ranks.run(lambda rank: rounds[rank].gather_reveals(survivors, dropped, ranks.allgather(rank)))
    assert torch.equal(rounds[0].unmask(total, survivors, dropped, first[0]), expected_sum(rows, survivors, bits))
    refusals = []

    def ask_again(rank):
        try:
            rounds[rank].reveal(cohort, [])
        except secagg.UnmaskingRefusedError as exc:
            refusals.append(str(exc))

    ranks.run(ask_again)
    assert len(refusals) == size and all("clients [5]" in m and "already treated as dropped" in m for m in refusals)
    assert {x.kind for x in first[0] if x.owner == 5} == {"private_key"}


def test_without_one_rank_s_reveals_the_sum_is_not_unmasked():
    cohort, d, bits = list(range(8)), 8, 16  # complete graph: 8 holders, t = 5; each rank holds 4
    src = rng.RandomSource(1)
    mine = [cohort[0::2], cohort[1::2]]
    ranks = ThreadRanks(2)
    rounds = ranks.run(lambda rank: (r := SecAggRound(cohort, bits, d, 0, src, local_clients=mine[rank]),
                                     r.exchange(ranks.allgather(rank), ranks.alltoall(rank)))[0])
    total = torch.zeros(d, dtype=torch.int64)
    with pytest.raises(secagg.TooFewSurvivorsError, match="surviving holder"):
        rounds[0].unmask(total, cohort, [], rounds[0].reveal(cohort, []))


@pytest.mark.parametrize("mine,match", [([[0, 1], [2]], "no rank holds the keys of clients \\[3\\]"),
                                        ([[0, 1, 2], [2, 3]], "local on two ranks")])
def test_exchange_refuses_a_client_on_no_rank_or_on_two(mine, match):
    ranks = ThreadRanks(2)
    with pytest.raises(RuntimeError, match=match):
        ranks.run(lambda rank: SecAggRound([0, 1, 2, 3], 16, 4, 0, rng.RandomSource(0), local_clients=mine[rank])
                  .exchange(ranks.allgather(rank), ranks.alltoall(rank)))


def test_integer_round_with_local_clients_needs_the_collectives():
    settings = IntegerSumSettings("discrete_gaussian", 16, 0.01, 0.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="allgather and alltoall"):
        IntegerSumRound(settings, 0, (0, 1, 2), 5, rng.RandomSource(0), bytes(16), local_clients=[0, 1, 2])


def test_a_secure_run_writes_none_of_its_clients_secrets(tmp_path, monkeypatch):
    made = record_client_secrets(monkeypatch)
    trainer = quiet_trainer(str(tmp_path), rounds=2, clients_per_round=5, seed=3, secure=True, checkpoint_every=1,
                            final_checkpoint=True, plugins=[UpdateClipping(0.5), DiscreteDistributedNoise(
                                noise_multiplier=0.5, bits=20, dropout=0.2, min_survivors=2)])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=10))
    assert len(made) == 10 and {s.round_idx for s in made} == {0, 1}
    needles = [v for s in made for v in (s.private_key, s.self_mask_seed)]
    needles += [n.hex().encode() for n in needles]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".ckpt" for p in files) and any(p.suffix == ".csv" for p in files)
    for p in files:
        data = p.read_bytes()
        assert not [n for n in needles if n in data], p


def test_ranks_shown_different_survivor_sets_refuse_to_unmask_at_any_threshold():
    """The split-view attack: the server tells rank 0's holders that client 5 dropped (they would reveal
    its private key) and the other ranks' that it survived (its self-mask seed). Through gather_reveals'
    consistency round every rank refuses before revealing anything, also at t=3 where the threshold
    alone would let both secrets through; the honest request afterwards still unmasks the sum."""
    cohort, d, bits, size = list(range(9)), 8, 20, 3
    src = rng.RandomSource(4)
    mine = [cohort[r::size] for r in range(size)]
    rows = rows_for(cohort, d, seed=3)
    ranks = ThreadRanks(size)

    rounds, masked = masked_rounds(ranks, cohort, bits, d, 1, src, mine, rows, threshold=3)
    views = {0: ([c for c in cohort if c != 5], [5]), 1: (cohort, []), 2: (cohort, [])}
    outcome = {}

    def split_request(rank):
        try:
            outcome[rank] = rounds[rank].gather_reveals(*views[rank], ranks.allgather(rank))
        except secagg.UnmaskingRefusedError as exc:
            outcome[rank] = str(exc)

    ranks.run(split_request)
    assert all(isinstance(v, str) and "different survivor sets" in v for v in outcome.values()), outcome
    honest = ranks.run(lambda rank: rounds[rank].gather_reveals(cohort, [], ranks.allgather(rank)))
    total = mod_sum(torch.stack([masked[c] for c in cohort]), bits)
    assert torch.equal(rounds[0].unmask(total, cohort, [], honest[0]), expected_sum(rows, cohort, bits))
