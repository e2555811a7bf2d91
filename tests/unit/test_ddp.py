"""Several devices in one peer (peer/train/ddp.py), on two CPU ranks over gloo.

Rank 0 is this test process, rank 1 a spawned process. The claim checked: two ranks with half the
batch each take exactly the step one process takes over the whole batch in two micro-batches of
half the batch. Each rank computes its half's gradient as that process computes the same
micro-batch (same rows, same 1/2 weight, one torch thread each), and the all-reduce adds the two
halves as gradient accumulation does; fp32 addition of two numbers is commutative, so the sums are
equal bit for bit and so is every AdamW update after them: the tolerance is zero. Against one
forward over the whole batch only the order of the fp32 sums over the batch's tokens differs: there
the gradients agree to the 1e-6 that issue 14 item 11 sets for accumulation.
"""

import pytest
import torch

from peer.train.ddp import DistributedInnerLoop
from peer.train.device import resolve_devices
from peer.train.inner import InnerLoop
from peer.train.model import build_model
from protocol.errors import ConfigError, RankFailed
from protocol.presets import tiny_run
from tests.unit.samplers import Fixed

RUN = tiny_run()
SPEC = RUN.inner_optimizer
STEPS = 6


def batches(rows=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (rows, RUN.data.seq_len_tokens + 1), generator=g) for _ in range(3)]


@pytest.fixture
def one_thread():
    """One torch thread in this process (rank 0 and the reference), as each spawned rank gets."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ranks(**kwargs) -> DistributedInnerLoop:
    return DistributedInnerLoop.launch(
        build_model(RUN.model), SPEC, Fixed(*batches()), devices=["cpu", "cpu"], **kwargs
    )


def theta(loop):
    return [p.detach().clone() for p in loop.params]


def test_two_ranks_take_the_step_of_one_process_over_the_whole_batch(one_thread):
    reference = InnerLoop(build_model(RUN.model), SPEC, Fixed(*batches()), micro_batch_sequences=4)
    whole = InnerLoop(build_model(RUN.model), SPEC, Fixed(*batches()))
    loop = ranks()
    try:
        first = loop.step(0)
        reduced = [p.grad.clone() for p in loop.params]
        reference.step(0)
        whole.step(0)
        for g, r, w in zip(reduced, (p.grad for p in reference.params), (p.grad for p in whole.params)):
            assert torch.equal(g, r)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert first.tokens == 8 * RUN.data.seq_len_tokens and first.micro_batch == 4
        for k in range(1, STEPS):
            assert loop.step(k).loss == reference.step(k).loss
        for a, b in zip(theta(loop), theta(reference)):
            assert torch.equal(a, b)
        digests = loop.theta_digests()
        assert len(digests) == 2 and digests[0] == digests[1]
    finally:
        loop.close()


def test_what_the_round_loop_writes_reaches_every_rank(one_thread):
    """θ ← φ, a fresh AdamW and a restored AdamW state on rank 0 are what rank 1 trains from."""
    reference = InnerLoop(build_model(RUN.model), SPEC, Fixed(*batches()), micro_batch_sequences=4)
    loop = ranks()
    phi = theta(loop)

    def write_theta(target):
        with torch.no_grad():
            for p, f in zip(target.params, phi):
                p.copy_(f)  # as the round loop's θ ← φ

    try:
        for target in (loop, reference):
            target.step(0)
            target.step(1)
            saved = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in target.state_dict().items()}
            write_theta(target)
            target.reset_optimizer()
            target.step(2)
            write_theta(target)
            target.load_state_dict(saved)
            target.step(3)
        for a, b in zip(theta(loop), theta(reference)):
            assert torch.equal(a, b)
        digests = loop.theta_digests()
        assert digests[0] == digests[1]
    finally:
        loop.close()


class OutOfMemoryOnRankZero(DistributedInnerLoop):
    """Rank 0 (this process) runs out of memory above 2 sequences per micro-batch; rank 1 never does."""

    def _accumulate_share(self, rows, batch_rows):
        if (self.micro_batch_sequences or rows.shape[0]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return super()._accumulate_share(rows, batch_rows)


def test_one_rank_out_of_memory_halves_the_micro_batch_on_every_rank(one_thread):
    """Rank 1 must not wait in a gradient all-reduce for a rank that redoes its step: both agree,
    halve and redo the step, and stay equal."""
    loop = OutOfMemoryOnRankZero.launch(build_model(RUN.model), SPEC, Fixed(*batches()), devices=["cpu", "cpu"])
    reference = InnerLoop(build_model(RUN.model), SPEC, Fixed(*batches()), micro_batch_sequences=2)
    try:
        result = loop.step(0)
        assert result.micro_batch == 2 and loop.oom_backoffs == 1
        assert result.loss == pytest.approx(reference.step(0).loss, abs=1e-6)
        loop.step(1)
        digests = loop.theta_digests()
        assert digests[0] == digests[1]
    finally:
        loop.close()


def test_a_rank_that_dies_stops_the_peer_with_one_line(one_thread):
    loop = ranks()
    try:
        loop.step(0)
        process = loop._processes[0]
        process.kill()
        process.join(10)
        with pytest.raises(RankFailed) as info:
            loop.step(1)
        assert "rank 1 exited" in str(info.value)
    finally:
        loop.close()
    assert not loop._processes[0].is_alive()


def test_a_batch_smaller_than_the_devices_is_refused():
    with pytest.raises(ConfigError) as info:
        DistributedInnerLoop.launch(build_model(RUN.model), SPEC, Fixed(batches(rows=1)[0]), devices=["cpu", "cpu"])
    assert "1 sequence(s)" in str(info.value) and "2 devices" in str(info.value)


def test_device_lists():
    assert resolve_devices("cpu,cpu") == [torch.device("cpu")] * 2
    assert resolve_devices("cpu") == [torch.device("cpu")]
    with pytest.raises(ConfigError) as info:
        resolve_devices("cpu,gpu")
    assert "--device gpu" in str(info.value)
