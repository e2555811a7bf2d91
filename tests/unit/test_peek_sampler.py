"""peer/train/data.py ``PeekSampler``: a batch read ahead is the one training gets next, and the
position a checkpoint keeps is the one before it."""

import torch

from peer.train.data import BatchSampler, PeekSampler


def _sampler(seed: int = 7) -> BatchSampler:
    return BatchSampler(torch.arange(10_000, dtype=torch.int64), seq_len=8, batch_sequences=4, seed=seed)


def test_the_batch_read_ahead_is_the_next_one_trained_on():
    plain, peeking = _sampler(), PeekSampler(_sampler())
    assert torch.equal(peeking.next_batch(), plain.next_batch())
    ahead = peeking.peek()[0].clone()
    assert torch.equal(peeking.peek()[0], ahead)  # reading ahead twice draws nothing more
    assert peeking.batches_drawn == 1
    expected = plain.next_batch()
    assert torch.equal(ahead, expected)
    assert torch.equal(peeking.next_batch(), expected)
    assert peeking.batches_drawn == 2
    assert torch.equal(peeking.next_batch(), plain.next_batch())


def test_a_position_saved_while_a_batch_is_read_ahead_trains_on_it_after_a_restart():
    peeking = PeekSampler(_sampler())
    peeking.next_batch()
    ahead = peeking.peek()[0].clone()
    saved = peeking.state()
    assert saved.batches_drawn == 1
    restarted = PeekSampler(_sampler())
    restarted.load_state(saved)
    assert torch.equal(restarted.next_batch(), ahead)


def test_loading_a_position_drops_the_batch_read_ahead():
    peeking = PeekSampler(_sampler())
    start = peeking.state()
    first = peeking.next_batch().clone()
    peeking.peek(3)
    peeking.load_state(start)
    assert torch.equal(peeking.next_batch(), first)


def test_batches_read_ahead_come_in_order_and_a_restart_resumes_at_the_first_still_ahead():
    plain, peeking = _sampler(), PeekSampler(_sampler())
    expected = [plain.next_batch() for _ in range(4)]
    ahead = [b.clone() for b in peeking.peek(3)]
    assert all(torch.equal(a, e) for a, e in zip(ahead, expected[:3], strict=True))
    assert torch.equal(peeking.next_batch(), expected[0])
    saved = peeking.state()  # two batches still ahead: a restart trains on them first
    assert saved.batches_drawn == 1 and peeking.batches_drawn == 1
    restarted = PeekSampler(_sampler())
    restarted.load_state(saved)
    assert all(torch.equal(restarted.next_batch(), e) for e in expected[1:])
