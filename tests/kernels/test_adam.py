"""CPU Adam: every version agrees with torch; 16-bit outputs are torch's rounding; bad input changes nothing."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minioffload.kernels import adam
from minioffload.kernels.lowp import as_bits, from_bits

# Float32 agreement to a few ulps of the operands. The values here are O(1), so atol 1e-6 is about 8 ulps of 1.0:
# where two O(1) terms nearly cancel (exp_avg = lerp(m, g) with m ~ -g, or p - step), one ulp of a term is an
# absolute error no relative tolerance covers. The textbook NumPy versions (beta1*m + (1-beta1)*g instead of
# torch's lerp) and L2 decay (g + wd*p, which LLVM may round once where torch rounds twice) land there.
RTOL, ATOL = 1e-6, 1e-6


def torch_reference(p0, grads, *, lr, beta1, beta2, eps, weight_decay, decoupled, decay_in_fp64=False):
    """torch's Adam (L2 decay) or AdamW. `decay_in_fp64`: L2 decay's g + wd * p formed in float64 and rounded once,
    another correct rounding of the same step (torch forms it in fp32)."""
    param = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    decay_here = decay_in_fp64 and not decoupled
    opt = cls([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0 if decay_here else weight_decay,
              foreach=False)
    for g in grads:
        param.grad = (g.double() + weight_decay * param.detach().double()).float() if decay_here else g.clone()
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


hyper = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-4, 1e-3, 3e-2]),
    "beta1": st.sampled_from([0.0, 0.3, 0.9]),  # 0.3: torch's lerp takes its other branch
    "beta2": st.sampled_from([0.9, 0.999]),
    "eps": st.sampled_from([1e-8, 1e-6]),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    "decoupled": st.booleans(),
})


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([0, 1, 2, 7, 1023, 4097]), steps=st.integers(1, 4), h=hyper, seed=st.integers(0, 2**16))
# a draw where L2 decay cancels to about eps in one element (g = 0.0108, wd * p = -0.0108)
@example(n=4097, steps=1, h={"lr": 0.03, "beta1": 0.0, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.01,
                             "decoupled": False}, seed=36)
def test_every_fp32_version_matches_torch(n, steps, h, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    expected = torch_reference(p0, grads, **h)
    # L2 decay's g + wd * p can cancel to about eps, where the step lr * m / (sqrt(v) + eps) turns one ulp of the
    # decayed gradient into many ulps of the weight: allow, per element, what a one-rounding difference in forming it
    # moves torch's own result (zero without L2 decay)
    spread = [(a - b).abs() for a, b in zip(expected, torch_reference(p0, grads, **h, decay_in_fp64=True),
                                           strict=True)]
    for name, fn in adam.VERSIONS.items():
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step, g in enumerate(grads, 1):
            fn(p, g, m, v, step=step, **h)
        for got, want, slack, what in zip((p, m, v), expected, spread, ("param", "exp_avg", "exp_avg_sq"),
                                          strict=True):
            off = (got - want).abs() > ATOL + RTOL * want.abs() + 2 * slack
            assert not off.any(), (f"{name} {what} differs from torch at {int(off.sum())} of {n} elements, e.g. "
                                   f"{got[off][:3].tolist()} against {want[off][:3].tolist()}")


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(["bf16", "fp16"]), n=st.sampled_from([1, 3, 1000, 5003]), steps=st.integers(1, 3),
       h=hyper, seed=st.integers(0, 2**16))
def test_mixed_pass_equals_torch_rounding_of_the_fp32_result(dtype, n, steps, h, seed):
    lowp = from_bits(np.zeros(1, np.uint16), dtype).dtype
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads_lowp = [torch.randn(n, generator=gen).to(lowp) for _ in range(steps)]
    want_p, want_m, want_v = torch_reference(p0, [g.float() for g in grads_lowp], **h)
    p, m, v, out = p0.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=lowp)
    for step, g in enumerate(grads_lowp, 1):
        adam.adam_mixed(p, g, m, v, out, dtype=dtype, step=step, **h)
    torch.testing.assert_close(p, want_p, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, want_v, rtol=RTOL, atol=ATOL)
    # the 16-bit weights are exactly the rounding of our fp32 master weights, as torch rounds them
    assert torch.equal(out.view(torch.int16), p.to(lowp).view(torch.int16))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["adam_ref", "adam_inplace", "adam_fused", "adam_mixed"])
def test_nan_and_inf_in_the_gradient_propagate_as_in_torch(name, dtype):
    if name != "adam_mixed" and dtype == "fp16":
        pytest.skip("fp32 versions do not take a dtype")
    grad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.5])
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    want = torch_reference(p0, [grad], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    p, m, v = p0.clone(), torch.zeros(5), torch.zeros(5)
    if name == "adam_mixed":
        lowp = torch.bfloat16 if dtype == "bf16" else torch.float16
        out = torch.empty(5, dtype=lowp)
        adam.adam_mixed(p, grad.to(lowp), m, v, out, dtype=dtype, step=1)
        assert torch.equal(out.float().isnan(), want[0].isnan())
    else:
        getattr(adam, name)(p, grad, m, v, step=1)
    for got, expected in zip((p, m, v), want, strict=True):
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
        finite = ~expected.isnan() & ~expected.isinf()
        torch.testing.assert_close(got[finite], expected[finite], rtol=RTOL, atol=ATOL)


def test_updating_a_slice_updates_only_that_slice():
    p, g, m, v = torch.randn(100), torch.randn(100), torch.zeros(100), torch.zeros(100)
    before = p.clone()
    adam.adam_fused(p[20:50], g[20:50], m[20:50], v[20:50], step=1)
    assert torch.equal(p[:20], before[:20]) and torch.equal(p[50:], before[50:])
    assert not torch.equal(p[20:50], before[20:50]) and m[:20].eq(0).all()


def _state():
    return [torch.randn(16), torch.randn(16), torch.rand(16), torch.rand(16)]


@pytest.mark.parametrize("name", list(adam.VERSIONS))
@pytest.mark.parametrize("change, match", [
    (lambda a, kw: a.__setitem__(1, torch.randn(15)), "same number of elements"),
    (lambda a, kw: a.__setitem__(2, torch.zeros(16, dtype=torch.float64)), "dtype float64"),
    (lambda a, kw: a.__setitem__(3, torch.rand(32)[::2]), "not contiguous"),
    (lambda a, kw: kw.update(lr=-1.0), "lr must be >= 0"),
    (lambda a, kw: kw.update(beta1=1.0), r"beta1 must be in \[0, 1\)"),
    (lambda a, kw: kw.update(beta2=float("nan")), "beta2"),
    (lambda a, kw: kw.update(eps=0.0), "eps must be > 0"),
    (lambda a, kw: kw.update(step=0), "step must be an integer >= 1"),
    (lambda a, kw: kw.update(step=1.5), "step must be an integer"),
    (lambda a, kw: kw.update(weight_decay=-0.1), "weight_decay"),
])
def test_bad_input_is_refused_before_anything_is_written(name, change, match):
    arrays, kwargs = _state(), {"step": 1}
    change(arrays, kwargs)
    before = [a.clone() for a in arrays]
    with pytest.raises(ValueError, match=match):
        adam.VERSIONS[name](*arrays, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(arrays, before, strict=True))


def test_mixed_refuses_mismatched_16_bit_buffers_and_changes_nothing():
    p, m, v = torch.randn(8), torch.zeros(8), torch.zeros(8)
    before = p.clone()
    with pytest.raises(ValueError, match="is torch.float16 but dtype='bf16'"):
        adam.adam_mixed(p, torch.zeros(8, dtype=torch.float16), m, v, torch.empty(8, dtype=torch.bfloat16), step=1)
    with pytest.raises(ValueError, match="param_lowp_out has 4 elements"):
        adam.adam_mixed(p, torch.zeros(8, dtype=torch.bfloat16), m, v, torch.empty(4, dtype=torch.bfloat16), step=1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        adam.adam_mixed(p, torch.zeros(8, dtype=torch.bfloat16), m, v, torch.empty(8, dtype=torch.bfloat16),
                        dtype="fp8", step=1)
    assert torch.equal(p, before) and m.eq(0).all()


def test_set_threads_refuses_out_of_range():
    with pytest.raises(ValueError, match="threads must be in 1.."):
        adam.set_threads(0)


def test_as_bits_round_trips_without_copying():
    t = torch.randn(10).to(torch.bfloat16)
    bits = as_bits(t)
    assert bits.dtype == np.uint16 and bits.ctypes.data == t.data_ptr()
    assert torch.equal(from_bits(bits, "bf16"), t)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        as_bits(torch.randn(3))


def test_sum_of_squares_matches_float64_torch_and_refuses_other_tensors():
    from minioffload.kernels.gradnorm import sum_of_squares

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 3
    assert sum_of_squares(x) == pytest.approx(float(x.double().square().sum()), rel=1e-12)
    with pytest.raises(ValueError, match="contiguous fp32"):
        sum_of_squares(x.double())
    with pytest.raises(ValueError, match="not contiguous"):
        sum_of_squares(x[::2])


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-16])
def test_the_out_of_place_pass_is_the_in_place_one_bit_for_bit_and_leaves_its_inputs(scale):
    from minioffload.kernels.adam import adam_fused_into

    g = torch.Generator().manual_seed(1)
    param, grad, exp_avg, exp_avg_sq = (torch.randn(10_007, generator=g) for _ in range(4))
    exp_avg_sq.abs_()
    before = [t.clone() for t in (param, grad, exp_avg, exp_avg_sq)]
    outs = [torch.full_like(param, float("nan")) for _ in range(3)]
    adam_fused_into(param, grad, exp_avg, exp_avg_sq, *outs, grad_scale=scale, step=4, lr=1e-2, weight_decay=0.1)
    in_place = [t.clone() for t in before]
    in_place[1].mul_(scale)
    adam.adam_fused(*in_place, step=4, lr=1e-2, weight_decay=0.1)
    assert all(torch.equal(a, b) for a, b in zip(outs, [in_place[0], in_place[2], in_place[3]], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, (param, grad, exp_avg, exp_avg_sq), strict=True))
    with pytest.raises(ValueError, match=r"_out arrays have \[3, 3, 3\] elements"):
        adam_fused_into(param, grad, exp_avg, exp_avg_sq, *(torch.empty(3) for _ in range(3)), grad_scale=1.0, step=1)
