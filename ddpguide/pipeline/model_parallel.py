"""Model parallelism on one machine: a model's layers placed on two devices.

The models of the source article ("Single-Machine Model Parallel Best
Practices"), written without device names: each model takes its two devices
as arguments and defaults to :func:`default_devices`, which gives ``cuda:0``
and ``cuda:1`` when the machine has two GPUs and the CPU twice otherwise. On
the CPU the code runs unchanged and teaches the same lessons about where
tensors live and who waits for whom; only the speed story differs (chapter 5).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet

from ddpguide.core.models import ToyModel
from ddpguide.core.runtime import select_runtime
from ddpguide.pipeline.stages import check_split_size

Devices = Sequence["torch.device | str"]


def default_devices(count: int = 2) -> tuple[torch.device, ...]:
    """``count`` devices for the parts of a model: one GPU each when there are
    enough GPUs, otherwise the CPU for every part (``DDPGUIDE_DEVICE`` overrides)."""
    runtime = select_runtime(count)
    return tuple(runtime.device(i) for i in range(count))


def _two_devices(devices: Devices | None) -> tuple[torch.device, torch.device]:
    devices = default_devices(2) if devices is None else tuple(torch.device(d) for d in devices)
    if len(devices) != 2:
        raise ValueError(f"expected two devices, got {len(devices)}")
    return devices[0], devices[1]


class TwoDeviceToyModel(ToyModel):
    """The source's toy model with ``net1`` on the first device and ``net2`` on the second.

    The same layers as :class:`ddpguide.core.models.ToyModel` (so the two load
    each other's state dicts); only where they live and the forward differ.
    """

    def __init__(self, devices: Devices | None = None) -> None:
        super().__init__()
        self.dev0, self.dev1 = _two_devices(devices)
        self.net1.to(self.dev0)
        self.net2.to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        # The one extra line model parallelism needs: move the activation.
        return self.net2(x.to(self.dev1))


class ModelParallelResNet50(ResNet):
    """torchvision's ResNet50 cut after ``layer2``: stem..layer2 on the first device,
    layer3..fc on the second (the source's split).

    ``seq1``/``seq2`` hold the same modules as the ResNet attributes, so the
    parameters are shared, not copied; :func:`unsplit_resnet50` gives the plain
    model with the same weights.
    """

    def __init__(self, devices: Devices | None = None, num_classes: int = 1000, **kwargs) -> None:
        super().__init__(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, **kwargs)
        self.dev0, self.dev1 = _two_devices(devices)
        self.seq1 = nn.Sequential(
            self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2
        ).to(self.dev0)
        self.seq2 = nn.Sequential(self.layer3, self.layer4, self.avgpool).to(self.dev1)
        self.fc.to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq2(self.seq1(x.to(self.dev0)).to(self.dev1))
        return self.fc(x.flatten(1))


class PipelineParallelResNet50(ModelParallelResNet50):
    """The split ResNet50 fed in micro-batches of ``split_size`` samples (the source's
    pipelining), so that device 0 can start on micro-batch i+1 while device 1 works
    on micro-batch i.

    The overlap needs asynchronous devices: CUDA launches kernels and returns, so
    one Python thread keeps both GPUs busy. On the CPU every op runs to completion
    in the calling thread, so this version is correct but never overlaps; use
    :mod:`ddpguide.pipeline.stages` (one process per stage) for a CPU pipeline.

    A batch that ``split_size`` does not divide ends with a smaller micro-batch;
    a ``split_size`` larger than the batch gives one micro-batch. In train mode
    BatchNorm normalises each micro-batch with its own statistics (see
    :func:`microbatch_reference`).
    """

    def __init__(self, split_size: int = 20, devices: Devices | None = None, **kwargs) -> None:
        super().__init__(devices=devices, **kwargs)
        self.split_size = split_size

    @property
    def split_size(self) -> int:
        return self._split_size

    @split_size.setter
    def split_size(self, value: int) -> None:
        self._split_size = check_split_size(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splits = iter(x.to(self.dev0).split(self.split_size, dim=0))
        s_next = next(splits)
        s_prev = self.seq1(s_next).to(self.dev1)
        ret = []
        for s_next in splits:
            # A: s_prev runs on dev1 ...
            s_prev = self.seq2(s_prev)
            ret.append(self.fc(s_prev.flatten(1)))
            # B: ... while s_next runs on dev0 (concurrently on GPUs, not on CPU).
            s_prev = self.seq1(s_next).to(self.dev1)
        s_prev = self.seq2(s_prev)
        ret.append(self.fc(s_prev.flatten(1)))
        return torch.cat(ret)


_SPLIT_ONLY_PREFIXES = ("seq1.", "seq2.")


def resnet_state_dict(model: ModelParallelResNet50) -> dict[str, torch.Tensor]:
    """The weights under torchvision's names, on the CPU (``seq1``/``seq2`` aliases dropped)."""
    return {
        k: v.detach().cpu()
        for k, v in model.state_dict().items()
        if not k.startswith(_SPLIT_ONLY_PREFIXES)
    }


def unsplit_resnet50(model: ModelParallelResNet50, device: torch.device | str = "cpu") -> ResNet:
    """A plain torchvision ResNet50 with the same weights, on one device."""
    plain = ResNet(Bottleneck, [3, 4, 6, 3], num_classes=model.fc.out_features)
    plain.load_state_dict(resnet_state_dict(model))
    return plain.to(device).train(model.training)


def load_resnet_weights(model: ModelParallelResNet50, state: dict[str, torch.Tensor]) -> None:
    """Load a plain ResNet50 state dict into a split model (each tensor to its device)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if not k.startswith(_SPLIT_ONLY_PREFIXES)]
    if real_missing or unexpected:
        raise KeyError(f"state dict does not fit: missing {real_missing}, unexpected {unexpected}")


def max_scaled_error(actual, expected) -> float:
    """Largest difference between two tensors, or two dicts of tensors with the same keys,
    relative to the largest entry of ``expected`` (absolute where entries are below 1).

    Float32 sums taken in another order (another batch size, another thread
    count) differ by about 1e-7 of the magnitude; a real bug is far above 1e-5.
    """
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            raise KeyError(f"different keys: {sorted(set(actual) ^ set(expected))[:5]}")
        return max((max_scaled_error(actual[k], expected[k]) for k in expected), default=0.0)
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} differs from {tuple(expected.shape)}")
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    return (actual - expected).abs().max().item() / scale if expected.numel() else 0.0


def microbatch_reference(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, split_size: int, loss_fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a micro-batched model computes, on an unsplit model: forward each
    micro-batch on its own and accumulate gradients.

    ``loss_fn(output, target)`` must return a *sum* over samples divided by the
    full batch size, so the accumulated loss and gradients are the full batch's
    whenever the model treats samples independently (eval-mode BatchNorm). With
    train-mode BatchNorm this is the reference a pipeline must match instead.
    Returns (output, loss); gradients are left in ``model``'s parameters.
    """
    split_size = check_split_size(split_size)
    outputs, losses = [], []
    for xs, ts in zip(x.split(split_size), target.split(split_size)):
        out = model(xs)
        loss = loss_fn(out, ts.to(out.device))
        loss.backward()
        outputs.append(out.detach())
        losses.append(loss.detach())
    return torch.cat(outputs), torch.stack(losses).sum()


def forward_backward(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn):
    """One forward and backward pass: (output, loss, gradients under torchvision's names).

    The split model's ``seq1``/``seq2`` aliases are left out, so the gradients
    of a split and an unsplit ResNet50 can be compared name by name.
    """
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, target.to(out.device))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None and not n.startswith(_SPLIT_ONLY_PREFIXES)}
    return out.detach(), loss.detach(), grads
