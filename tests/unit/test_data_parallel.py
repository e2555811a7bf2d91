"""lab/data_parallel.py: the data-parallel ceiling, one model on every peer's batches at once."""

import pytest
import torch

from lab.data_parallel import ConcatSampler, peer_samplers, run_data_parallel
from lab.sim_results import butterfly_bytes
from peer.train.data import validation_batch
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def test_a_batch_is_every_peers_next_batch_in_order(corpus):
    m = tiny_run()
    batches = [s.next_batch() for s in peer_samplers(m, corpus, 3, seed=4)]
    joined = ConcatSampler(peer_samplers(m, corpus, 3, seed=4)).next_batch()
    assert torch.equal(joined, torch.cat(batches))
    assert joined.shape[0] == 3 * m.batch_sequences
    with pytest.raises(ValueError, match="at least one sampler"):
        ConcatSampler([])


def test_it_trains_the_tokens_of_n_peers_and_reports_the_ring_all_reduce_bytes(corpus):
    m = tiny_run()
    seen = []
    r = run_data_parallel(m, corpus, peers=2, rounds=2, seed=1, eval_every_rounds=1, on_eval=seen.append)
    assert r.method == "data-parallel" and [h.round_ for h in r.history] == [0, 1, 2] and seen == r.history
    H = m.sync.inner_steps
    assert r.history[-1].tokens == 2 * H * 2 * m.batch_sequences * m.data.seq_len_tokens
    assert r.bytes_sent_per_peer == pytest.approx(2 * H * butterfly_bytes(r.parameters, 2))
    assert r.history[-1].loss_bpb < r.history[0].loss_bpb  # it learns
    assert r.screening == {}


def test_bad_sizes_are_refused_naming_them(corpus):
    with pytest.raises(ValueError, match="peers = 0"):
        run_data_parallel(tiny_run(), corpus, peers=0, rounds=1)
    assert validation_batch(corpus, tiny_run().data).dtype == torch.int64


def test_compare_names_what_each_row_ran_on(corpus):
    from bench.compare import source_of
    from lab.sim_results import SimulationResult

    r = run_data_parallel(tiny_run(), corpus, peers=1, rounds=1)
    old = SimulationResult("data-parallel", 1, 0, 1, 5, r.parameters, 0.0, 0.0)
    assert source_of([r]) == "one model" and source_of([r, old]) == "mixed"
