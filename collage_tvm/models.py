"""Models defined in code with random weights (no downloads): for the demo, tests, benchmarks."""
from __future__ import annotations

import os


def _torch():
    import torch
    import torch.nn as nn

    return torch, nn


def resnet(layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000, dims: int = 2):
    """ResNet with bottleneck blocks; ``layers=(3, 4, 6, 3)`` is ResNet-50. ``dims=3``: the
    video variant (Conv3d/BatchNorm3d, a 3x7x7 stem striding only in space, mean pool)."""
    torch, nn = _torch()
    conv, norm = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            self.c1, self.b1 = conv(cin, mid, 1, bias=False), norm(mid)
            self.c2, self.b2 = conv(mid, mid, 3, stride, 1, bias=False), norm(mid)
            self.c3, self.b3 = conv(mid, mid * 4, 1, bias=False), norm(mid * 4)
            self.down = None
            if stride != 1 or cin != mid * 4:
                self.down = nn.Sequential(conv(cin, mid * 4, 1, stride, bias=False),
                                          norm(mid * 4))

        def forward(self, x):
            r = x if self.down is None else self.down(x)
            y = torch.relu(self.b1(self.c1(x)))
            y = torch.relu(self.b2(self.c2(y)))
            return torch.relu(self.b3(self.c3(y)) + r)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            if dims == 2:
                self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                          nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            else:
                self.stem = nn.Sequential(
                    nn.Conv3d(3, width, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                    nn.BatchNorm3d(width), nn.ReLU(), nn.MaxPool3d(3, 2, 1))
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
            if dims == 2:
                return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
            return self.fc(x.mean((2, 3, 4)))

    torch.manual_seed(0)
    model = ResNet().eval()
    with torch.no_grad():  # random but non-trivial BN statistics, so folding is exercised
        for m in model.modules():
            if isinstance(m, norm):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


def resnet50():
    return resnet((3, 4, 6, 3), 64), (1, 3, 224, 224)


def resnet_small():
    """Two stages of thin bottlenecks on a 56x56 input: seconds to search, same op mix."""
    return resnet((1, 1), 16, num_classes=10), (1, 3, 56, 56)


def bert(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072,
         seq: int = 128, vocab: int = 30522):
    """A BERT encoder (post-norm, GELU), attention written out as matmuls and a softmax.

    Input: token ids ``(1, seq)`` int64; output: the last hidden states ``(1, seq, hidden)``.
    """
    torch, nn = _torch()
    head_dim = hidden // heads

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
            self.o = nn.Linear(hidden, hidden)
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x):
            b, s, _ = x.shape

            def split(t):
                return t.reshape(b, s, heads, head_dim).permute(0, 2, 1, 3)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / head_dim ** 0.5, dim=-1)
            ctx = torch.matmul(att, v).permute(0, 2, 1, 3).reshape(b, s, hidden)
            x = self.ln1(x + self.o(ctx))
            return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, hidden)
            self.pos = nn.Parameter(torch.randn(1, seq, hidden) * 0.02)
            self.ln = nn.LayerNorm(hidden)
            self.layers = nn.Sequential(*[Layer() for _ in range(layers)])

        def forward(self, ids):
            return self.layers(self.ln(self.emb(ids) + self.pos))

    torch.manual_seed(0)
    model = Bert().eval()
    with torch.no_grad():  # BERT's init scale keeps activations in range
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.02)
    return model, (1, seq)


def bert_base():
    return bert()


def bert_small():
    """Two thin layers on 32 tokens: the same op mix as BERT-base in seconds."""
    return bert(layers=2, hidden=128, heads=2, ffn=512, seq=32, vocab=1000)


MODELS = {"resnet50": resnet50, "resnet_small": resnet_small, "bert_base": bert_base,
          "bert_small": bert_small}


def example_input(name: str, shape=None, seed: int = 1):
    """A deterministic example input for model ``name`` (token ids for BERT, an image otherwise)."""
    torch, _ = _torch()
    if shape is None:
        _, shape = MODELS[name]()
    torch.manual_seed(seed)
    if name.startswith("bert"):
        return torch.randint(0, 1000, shape, dtype=torch.int64)
    return torch.randn(*shape)


def export_onnx(name: str, path: str) -> str:
    """Write model ``name`` to ``path`` as ONNX (IR version 8: onnxruntime 1.31 reads <= 13)."""
    torch, _ = _torch()
    import onnx

    model, shape = MODELS[name]()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    x = example_input(name, shape)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"])
    proto = onnx.load(path)
    if proto.ir_version > 10:
        proto.ir_version = 10
        onnx.save(proto, path)
    return path
