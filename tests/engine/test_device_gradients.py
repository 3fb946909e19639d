"""The gradients kept on the device (engine/gradients.py): the overflow check and the clip norm read them on the
device and bring one number (or one flag) per tensor to the host in one sync, never one sync per tensor, and never
with a float64 copy of a gradient."""

import math
import warnings

import pytest
import torch

from minioffload.devices.cuda import CudaDevice
from minioffload.engine.gradients import GradientPath
from minioffload.engine.packing import LossScale, Packing

SCALE = 1024.0


@pytest.fixture
def path(sim):
    """A gradient path with loss scaling on and no subgroup on the host: only the device gradients count."""
    return GradientPath(Packing(sim, [], {}), LossScale(SCALE, dynamic=False, growth_interval=2000))


def on_device(sim, values: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for value in values:
        grad = sim.empty(value.shape, value.dtype, "grad")
        grad.copy_(value)
        grads.append(grad)
    return grads


@pytest.fixture
def syncs(monkeypatch):
    """Counts the device-to-host reads (each a sync on a GPU); a float64 copy of a tensor fails the test."""
    count = {"syncs": 0}
    for name in ("item", "tolist", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, real=real, **kwargs):
            count["syncs"] += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def no_double(self, *args, **kwargs):
        raise AssertionError(f"a float64 copy of a {tuple(self.shape)} tensor")

    monkeypatch.setattr(torch.Tensor, "double", no_double)
    return count


def test_the_overflow_check_is_one_sync_for_all_device_gradients(sim, path, syncs):
    g = torch.Generator().manual_seed(0)
    grads = on_device(sim, [torch.randn(n, generator=g) for n in (7, 300, 1000, 5)] + [torch.ones(64).bfloat16()])
    assert path.finite({}, grads) is True and syncs["syncs"] == 1
    grads[2][17] = float("nan")
    assert path.finite({}, grads) is False and syncs["syncs"] == 2


def test_the_clip_norm_is_one_sync_and_equals_clip_grad_norm(sim, path, syncs):
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(n, generator=g) * 10 for n in (7, 300, 1000, 5)]
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in values]
    for p, v in zip(params, values, strict=True):
        p.grad = v.clone()
    theirs = float(torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf))
    syncs["syncs"] = 0
    coef, norm = path.clip_coefficient(1e-3, {}, on_device(sim, values))
    assert syncs["syncs"] == 1
    assert norm == pytest.approx(theirs / SCALE, rel=1e-6)  # unscaled
    assert norm > 1e-3 and coef == pytest.approx(1e-3 / (norm + 1e-6) / SCALE, rel=1e-12)  # clipped


def test_a_16_bit_device_gradient_is_measured_in_fp32(sim, path, syncs):
    value = torch.linspace(-300, 300, 4097).bfloat16()
    exact = math.sqrt(sum(float(x) ** 2 for x in value.float()))  # (python floats: no float64 tensor)
    syncs["syncs"] = 0
    _, norm = path.clip_coefficient(1.0, {}, on_device(sim, [value]))
    assert syncs["syncs"] == 1 and norm == pytest.approx(exact / SCALE, rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_each_check_synchronizes_once():
    with CudaDevice() as dev:
        path = GradientPath(Packing(dev, [], {}), LossScale(SCALE, dynamic=False, growth_interval=2000))
        grads = [torch.randn(n, device="cuda") for n in (7, 300, 1000, 5)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")  # torch warns at each synchronizing call
        try:
            for check in (lambda: path.finite({}, grads), lambda: path.clip_coefficient(1.0, {}, grads)):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    check()
                assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
