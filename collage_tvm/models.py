"""Models defined in code with random weights (no downloads): for the demo, tests, benchmarks."""
from __future__ import annotations

import os


def _torch():
    import torch
    import torch.nn as nn

    return torch, nn


def resnet(layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000):
    """ResNet with bottleneck blocks; ``layers=(3, 4, 6, 3)`` is ResNet-50."""
    torch, nn = _torch()

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
            self.c3, self.b3 = nn.Conv2d(mid, mid * 4, 1, bias=False), nn.BatchNorm2d(mid * 4)
            self.down = None
            if stride != 1 or cin != mid * 4:
                self.down = nn.Sequential(nn.Conv2d(cin, mid * 4, 1, stride, bias=False),
                                          nn.BatchNorm2d(mid * 4))

        def forward(self, x):
            r = x if self.down is None else self.down(x)
            y = torch.relu(self.b1(self.c1(x)))
            y = torch.relu(self.b2(self.c2(y)))
            return torch.relu(self.b3(self.c3(y)) + r)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], width
            for i, n in enumerate(layers):
                mid = width * 2 ** i
                for j in range(n):
                    blocks.append(Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
                    cin = mid * 4
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    model = ResNet().eval()
    with torch.no_grad():  # random but non-trivial BN statistics, so folding is exercised
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


def resnet50():
    return resnet((3, 4, 6, 3), 64), (1, 3, 224, 224)


def resnet_small():
    """Two stages of thin bottlenecks on a 56x56 input: seconds to search, same op mix."""
    return resnet((1, 1), 16, num_classes=10), (1, 3, 56, 56)


MODELS = {"resnet50": resnet50, "resnet_small": resnet_small}


def export_onnx(name: str, path: str) -> str:
    """Write model ``name`` to ``path`` as ONNX (IR version 8: onnxruntime 1.31 reads <= 13)."""
    torch, _ = _torch()
    import onnx

    model, shape = MODELS[name]()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.manual_seed(1)
    x = torch.randn(*shape)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["logits"])
    proto = onnx.load(path)
    if proto.ir_version > 10:
        proto.ir_version = 10
        onnx.save(proto, path)
    return path
