"""DiLoCo's outer step against the paper's equations written out here, and against torch's SGD."""

import pytest
import torch

from peer.train.outer import DiLoCo, pseudo_gradient
from protocol.errors import BadPayload
from protocol.manifest import OuterOptimizerSpec


def reference_nesterov(phi0, deltas, lr, mu):
    """DiLoCo (arXiv 2311.08105, Alg. 1) outer step, SGD with Nesterov momentum, written from scratch:
    m_t = μ m_{t-1} + Δ̄_t ;  φ_{t+1} = φ_t − lr (Δ̄_t + μ m_t)."""
    phi, m = phi0.clone(), torch.zeros_like(phi0)
    for d in deltas:
        m = mu * m + d
        phi = phi - lr * (d + mu * m)
    return phi


def reference_heavy_ball(phi0, deltas, lr, mu):
    phi, m = phi0.clone(), torch.zeros_like(phi0)
    for d in deltas:
        m = mu * m + d
        phi = phi - lr * m
    return phi


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_reference_over_several_rounds(nesterov):
    g = torch.Generator().manual_seed(0)
    shapes = [torch.Size([7, 5]), torch.Size([11])]
    phi = [torch.randn(s, generator=g) for s in shapes]
    phi0 = [p.clone() for p in phi]
    rounds = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    spec = OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=nesterov)
    outer = DiLoCo(shapes, spec)
    for deltas in rounds:
        outer.apply(phi, deltas)
    ref = reference_nesterov if nesterov else reference_heavy_ball
    for i in range(len(shapes)):
        expected = ref(phi0[i], [r[i] for r in rounds], 0.7, 0.9)
        torch.testing.assert_close(phi[i], expected, rtol=1e-5, atol=1e-6)


def test_outer_step_matches_torch_sgd_nesterov():
    g = torch.Generator().manual_seed(1)
    phi = [torch.randn(4, 3, generator=g)]
    param = torch.nn.Parameter(phi[0].clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    outer = DiLoCo([phi[0].shape], OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True))
    for _ in range(4):
        d = torch.randn(4, 3, generator=g)
        param.grad = d.clone()
        sgd.step()
        outer.apply(phi, [d])
    torch.testing.assert_close(phi[0], param.detach())


def test_pseudo_gradient_sign_is_phi_minus_theta():
    phi, theta = [torch.ones(3)], [torch.full((3,), 0.25)]
    torch.testing.assert_close(pseudo_gradient(phi, theta)[0], torch.full((3,), 0.75))


def test_non_finite_mean_delta_is_rejected_and_phi_unchanged():
    phi = [torch.ones(3)]
    outer = DiLoCo([phi[0].shape], OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True))
    bad = torch.tensor([0.0, float("nan"), 1.0])
    with pytest.raises(BadPayload, match="NaN or inf"):
        outer.apply(phi, [bad])
    torch.testing.assert_close(phi[0], torch.ones(3))
    torch.testing.assert_close(outer.momentum[0], torch.zeros(3))


def test_wrong_shape_is_rejected():
    outer = DiLoCo([torch.Size([3])], OuterOptimizerSpec())
    with pytest.raises(BadPayload, match="shape"):
        outer.apply([torch.ones(3)], [torch.ones(4)])


@pytest.mark.parametrize("algorithm", ["diloco", "noloco", "independent"])
def test_a_finite_mean_that_would_overflow_phi_leaves_phi_and_momentum_unchanged(algorithm):
    """An outer step whose every input is finite can still overflow fp32: the step is refused
    (BadPayload) and φ and the outer state stay as they were."""
    from peer.train.outer import make_outer
    from protocol.errors import BadPayload
    from protocol.presets import default_run

    run = default_run().replace(sync={"algorithm": algorithm})
    outer = make_outer(run, [torch.Size([2])])
    if algorithm == "noloco":  # δ = −β·mean Δ + γ·(mean φ − φ) = 3e38; φ + δ = 6e38 → inf
        phi, mean = [torch.tensor([3e38, 0.0])], [torch.tensor([-3e38, -1.0]), torch.tensor([3e38, 0.0])]
    else:  # φ − lr·Δ̄ = −6e38 → −inf
        phi, mean = [torch.tensor([-3e38, 0.0])], [torch.tensor([3e38, 1.0])]
    before = [t.clone() for t in (*phi, *outer.state_tensors())]
    with pytest.raises(BadPayload, match="non-finite"):
        outer.apply(phi, mean)
    assert all(torch.equal(a, b) for a, b in zip(before, (*phi, *outer.state_tensors())))


@pytest.mark.parametrize("algorithm", ["diloco", "noloco", "independent"])
def test_the_step_on_copies_is_the_in_place_step_bit_for_bit_and_touches_nothing(algorithm):
    """``step_on_copies`` (the outer step prepared in the sync's thread) gives exactly the φ and
    outer state that ``apply`` leaves in place, over several rounds, and changes neither its inputs
    nor the algorithm's own state; a mean ``apply`` refuses it refuses too."""
    from peer.train.outer import make_outer, step_on_copies
    from protocol.presets import default_run

    torch.manual_seed(0)
    run = default_run().replace(sync={"algorithm": algorithm})
    shapes = [torch.Size([5, 3]), torch.Size([7])]
    live, shadow = make_outer(run, shapes), make_outer(run, shapes)
    phi = [torch.randn(s) for s in shapes]
    state = [t.clone() for t in shadow.state_tensors()]
    copies = 2 if algorithm == "noloco" else 1
    for _ in range(3):
        mean = [torch.randn(s) * 0.1 for _ in range(copies) for s in shapes]
        inputs = [t.clone() for t in (*phi, *state, *live.state_tensors())]
        new_phi, new_state = step_on_copies(live, phi, state, mean)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (*phi, *state, *live.state_tensors())))
        shadow.apply(phi, mean)  # the in-place step on an algorithm holding the same state
        assert all(torch.equal(a, b) for a, b in zip(new_phi, phi))
        assert all(torch.equal(a, b) for a, b in zip(new_state, shadow.state_tensors()))
        state = new_state
    with pytest.raises(BadPayload):
        step_on_copies(live, phi, state, [torch.full(s, float("nan")) for _ in range(copies) for s in shapes])


@pytest.mark.parametrize("nesterov", [True, False])
def test_preview_is_the_in_place_step_bit_for_bit_and_touches_nothing(nesterov):
    """``DiLoCo.preview`` (eager's start point) is the φ ``apply`` would leave, bit for bit, with
    momentum built up over earlier rounds; φ and the momentum are only read; a bad mean is refused."""
    torch.manual_seed(1)
    shapes = [torch.Size([5, 3]), torch.Size([7])]
    outer = DiLoCo(shapes, OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=nesterov))
    phi = [torch.randn(s) for s in shapes]
    for _ in range(3):
        outer.apply(phi, [torch.randn(s) * 0.1 for s in shapes])  # momentum is not zero any more
        mean = [torch.randn(s) * 0.1 for s in shapes]
        before = [t.clone() for t in (*phi, *outer.momentum)]
        preview = outer.preview(phi, mean)
        assert all(torch.equal(a, b) for a, b in zip(before, (*phi, *outer.momentum)))
        outer.apply(phi, mean)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(preview, phi))
    with pytest.raises(BadPayload, match="NaN or inf"):
        outer.preview(phi, [torch.full(s, float("nan")) for s in shapes])
    with pytest.raises(BadPayload, match="shape"):
        outer.preview(phi, [torch.zeros(2), torch.zeros(7)])


@pytest.mark.parametrize("algorithm", ["diloco", "diloco-heavy-ball", "noloco", "independent"])
def test_the_step_consuming_the_mean_is_the_step_on_copies_bit_for_bit(algorithm):
    """``step_consuming_mean`` (the blocking landing's step) gives the φ and outer state that
    ``step_on_copies`` gives, bit for bit, over rounds whose momentum builds up; DiLoCo's new
    momentum is the mean's own tensors (no model-sized copy beside them), φ and the state it read
    are unchanged; other algorithms leave the mean as it was."""
    from peer.train.outer import make_outer, step_consuming_mean, step_on_copies
    from protocol.presets import default_run

    torch.manual_seed(2)
    name = algorithm.removesuffix("-heavy-ball")
    run = default_run().replace(sync={"algorithm": name})
    if algorithm.endswith("heavy-ball"):
        run = run.replace(outer_optimizer={"nesterov": False})
    shapes = [torch.Size([5, 3]), torch.Size([7])]
    outer = make_outer(run, shapes)
    phi = [torch.randn(s) for s in shapes]
    state = [t.clone() for t in outer.state_tensors()]
    copies = 2 if name == "noloco" else 1
    for _ in range(3):
        mean = [torch.randn(s) * 0.1 for _ in range(copies) for s in shapes]
        kept = [t.clone() for t in mean]
        inputs = [t.clone() for t in (*phi, *state)]
        expected_phi, expected_state = step_on_copies(outer, phi, state, [t.clone() for t in mean])
        new_phi, new_state = step_consuming_mean(outer, phi, state, mean)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (*phi, *state)))
        for got, want in zip([*new_phi, *new_state], [*expected_phi, *expected_state], strict=True):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        if name == "diloco":
            assert all(m is d for m, d in zip(new_state, mean))
        else:
            assert all(torch.equal(a, b) for a, b in zip(mean, kept))
        phi, state = new_phi, new_state


def test_the_step_consuming_the_mean_refuses_what_the_step_on_copies_refuses():
    """A mean with NaN, of the wrong shape, or one that overflows fp32 in the step is refused
    (BadPayload) and leaves φ and the momentum as they were."""
    from peer.train.outer import step_consuming_mean

    outer = DiLoCo([torch.Size([3])], OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True))
    phi, state = [torch.ones(3)], [torch.full((3,), 0.5)]
    for bad, match in [
        ([torch.tensor([0.0, float("nan"), 1.0])], "NaN or inf"),
        ([torch.ones(4)], "shape"),
        ([torch.full((3,), -3e38)], "non-finite"),
    ]:
        with pytest.raises(BadPayload, match=match):
            step_consuming_mean(outer, phi, state, bad)
        assert torch.equal(phi[0], torch.ones(3)) and torch.equal(state[0], torch.full((3,), 0.5))
