"""`train` end to end on a CUDA GPU, one short run per feature of the command: the losses are the simulated device's.
(A run resumed from a checkpoint on a GPU: tests/train/test_checkpoint_async.py.) Marked `gpu`: skipped without CUDA,
collected everywhere.

The GPU is kept busy before every training forward (the `lagging_gpu` fixture), so it lags the host as it does in
real training: a copy or an update that is not ordered after the work it depends on reads or writes too early, and
the losses show it.

Tolerances. The GPU runs other kernels than the CPU (cuBLAS GEMMs, fused attention, other reduction orders), so an
fp32 loss differs from the sim's by float rounding: about 1e-6 of it at the first step (the same initial weights),
growing slowly as Adam's normalised updates follow slightly different gradients. A wrong result is far larger: one
step of this run lowers the loss by 0.1 to 0.3, so stale weights, a lost or doubled gradient or an unordered copy
move it by 1e-2 or more. Hence LOSS_TOL = 2e-3 against the sim (at the first step, rounding alone: 1e-4). bf16
rounds each value to 8 bits (4e-3 relative), so its runs are compared at BF16_TOL = 3e-2: there the check is that
every piece runs and learns on a GPU; the ordering is checked by the fp32 runs.
"""

import json

import pytest
import torch

from minioffload.train.loop import TrainConfig, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BASE = dict(model="tiny", block_size=32, batch_size=8, grad_accum=2, steps=3, lr=3e-3, eval_every=100,
            progress=False)
LOSS_TOL, FIRST_TOL, BF16_TOL = 2e-3, 1e-4, 3e-2


def options(**fields):
    return TrainConfig().optimizer.replace(**fields)  # train's defaults (subgroups, clipping) and these


# name -> (fields, exact): exact features train bit for bit like the plain offloaded run on the sim (the sim's tests
# say so), so their reference is that one sim run; the others are compared with the same run on the sim
FEATURES = {
    "offloaded optimizer": ({}, True),
    "optimizer on the device (no offload)": ({"offload": False}, False),
    "buckets and speculative update": ({"optimizer": options(bucket_numel=4096, speculative=True)}, True),
    "delayed update": ({"optimizer": options(delay_updates_after=1)}, False),
    "kept small parameters, dynamic loss scale": ({"optimizer": options(min_offload_numel=1000,
                                                                        loss_scale="dynamic")}, False),
    "hybrid update, static": ({"optimizer": options(gpu_fraction=0.5)}, False),
    "hybrid update, dynamic": ({"optimizer": options(stride=2)}, False),
    "streamed weights from the host": ({"params_on": "host", "prefetch": 1}, True),
    "streamed weights from NVMe": ({"params_on": "nvme", "prefetch": 2, "nvme_dir": "{tmp}/weights"}, True),
    "NVMe optimizer tier": ({"nvme_dir": "{tmp}/state"}, False),
    "activations offload, recompute": ({"activations": "offload,recompute"}, True),
    "activations selective, offload_input": ({"activations": "selective,offload_input"}, True),
    "bf16": ({"precision": "bf16"}, False),
    "gradients on NVMe": ({"nvme_dir": "{tmp}/state", "grads_on": "nvme",
                           "optimizer": options(subgroup_numel=8192, grad_buffers=2)}, False),
}
_sim_runs: dict[str, list[float]] = {}


def fields_for(fields: dict, tmp_path, device: str) -> dict:
    return {key: value.format(tmp=tmp_path / device) if isinstance(value, str) and "{tmp}" in value else value
            for key, value in fields.items()}


def run(tmp_path, device: str, name: str, **fields) -> object:
    return train(TrainConfig(**{**BASE, "device": device, "out_dir": str(tmp_path / device / name), **fields}))


def sim_reference(tmp_path, feature: str) -> list[float]:
    fields, exact = FEATURES[feature]
    key = "offloaded optimizer" if exact else feature
    if key not in _sim_runs:
        _sim_runs[key] = run(tmp_path, "sim", "reference", **fields_for(FEATURES[key][0], tmp_path, "sim")).losses
    return _sim_runs[key]


@pytest.mark.parametrize("feature", FEATURES)
def test_on_cuda_train_each_feature_as_on_the_sim(feature, tmp_path, lagging_gpu):
    fields, _ = FEATURES[feature]
    result = run(tmp_path, "cuda", "run", **fields_for(fields, tmp_path, "cuda"))
    reference = sim_reference(tmp_path, feature)
    tolerance = BF16_TOL if fields.get("precision") == "bf16" else LOSS_TOL
    assert result.losses == pytest.approx(reference, abs=tolerance), (result.losses, reference)
    first_tolerance = FIRST_TOL if tolerance == LOSS_TOL else tolerance  # before any update: rounding only
    assert result.losses[0] == pytest.approx(reference[0], abs=first_tolerance)
    assert result.losses[-1] < result.losses[0]  # it learns
    if feature == "offloaded optimizer":  # the batches went up from pinned buffers on their own stream
        names = {event["name"] for event in json.loads(result.paths["trace"].read_text())["traceEvents"]}
        assert "h2d batch" in names
