"""The model zoo: every model the tools run, defined in code with random weights (no
downloads), in one registry.

:data:`ZOO` maps each of the Collage paper's models to ``build(size) -> (torch.nn.Module,
example_input)`` where ``size`` is ``"small"`` (a few blocks on a small input: imports,
builds and runs in seconds, same op mix) or ``"paper"`` (the size the Collage paper
evaluates). :data:`FIXED` names one zoo model at one size (``resnet_small``,
``bert_small``, ``bert_base``: the names the demo, the tests and earlier benchmarks use).
Weights come from ``torch.manual_seed(0)``, modules are in eval mode, BatchNorm running
statistics are randomised slightly so BN folding is exercised; example inputs come from a
generator seeded 1. Benchmark numbers and cached costs refer to these exact models: a change
to a builder changes what they measure.

Paper input shapes: bert ``(1, 128)`` int64 token ids; dcgan ``(1, 100, 1, 1)``;
nasnet, resnet50, resnext50 ``(1, 3, 224, 224)``; resnet3d ``(1, 3, 16, 112, 112)``;
inception_v3 ``(1, 3, 299, 299)``; squeezenet ``(1, 3, 224, 224)``.
"""
from __future__ import annotations

import os

SIZES = ("small", "paper")


def _torch():
    import torch
    import torch.nn as nn

    return torch, nn


def _finish(model):
    """Eval mode plus random, non-trivial BatchNorm statistics."""
    torch, nn = _torch()
    model = model.eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


def _image(shape, seed: int = 1):
    torch, _ = _torch()
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _check_size(size):
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {SIZES}")


# --------------------------------------------------------------------------- the builders

def resnet(layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000, dims: int = 2,
           groups: int = 1, group_width: int | None = None, head: str | None = None):
    """A network of bottleneck blocks (1x1 -> 3x3 -> 1x1 conv, BN, ReLU, residual add):
    ResNet (``layers=(3, 4, 6, 3)``: ResNet-50), ResNeXt (``groups`` > 1: the 3x3 conv
    grouped, ``group_width`` channels per group in the first stage) and the 3D ResNet for
    video (``dims=3``: Conv3d/BatchNorm3d, a 3x7x7 stem striding only in space).

    Stage ``i`` has ``layers[i]`` blocks of inner width ``(groups * group_width or width) *
    2**i`` and ``4 * width * 2**i`` outputs, its first block striding 2 (after stage 0).
    ``head``: ``"pool"`` (adaptive average pool and flatten, as torchvision's ResNet; the
    2D default) or ``"mean"`` (a mean over the spatial axes; the 3D default), then a linear
    classifier. Weights from ``torch.manual_seed(0)``, eval mode, random BN statistics.
    """
    torch, nn = _torch()
    conv, norm = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)
    head = head or ("pool" if dims == 2 else "mean")
    inner = width if group_width is None else groups * group_width

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, cout, stride):
            super().__init__()
            self.c1, self.b1 = conv(cin, mid, 1, bias=False), norm(mid)
            self.c2 = conv(mid, mid, 3, stride, 1, groups=groups, bias=False)
            self.b2 = norm(mid)
            self.c3, self.b3 = conv(mid, cout, 1, bias=False), norm(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(conv(cin, cout, 1, stride, bias=False), norm(cout))

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
                mid, cout = inner * 2 ** i, 4 * width * 2 ** i
                for j in range(n):
                    blocks.append(Bottleneck(cin, mid, cout, 2 if (j == 0 and i > 0) else 1))
                    cin = cout
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            if head == "pool":
                return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
            return self.fc(x.mean(tuple(range(2, 2 + dims))))

    torch.manual_seed(0)
    return _finish(ResNet())


def bert_encoder(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072,
                 seq: int = 128, vocab: int = 30522):
    """A BERT encoder (post-norm, GELU), attention written out as matmuls and a softmax;
    the defaults are BERT-base. Input: token ids ``(1, seq)`` int64; output: the last
    hidden states ``(1, seq, hidden)``."""
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
    return model


# --------------------------------------------------------------------------- bert / resnet50

def bert(size: str = "small"):
    """BERT encoder (:func:`bert_encoder`): paper = BERT-base, seq 128; small = two layers
    of width 128 (2 heads, FFN 512) on 32 tokens, vocabulary 1000."""
    _check_size(size)
    torch, _ = _torch()
    if size == "paper":
        seq, model = 128, bert_encoder()
    else:
        seq, model = 32, bert_encoder(layers=2, hidden=128, heads=2, ffn=512, seq=32, vocab=1000)
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 1000, (1, seq), dtype=torch.int64, generator=g)


def resnet50(size: str = "small"):
    """ResNet-50 (:func:`resnet`); small = two stages of thin bottlenecks (width 16, 10
    classes) at 56x56: seconds to search, same op mix."""
    _check_size(size)
    if size == "paper":
        return resnet((3, 4, 6, 3), 64), _image((1, 3, 224, 224))
    return resnet((1, 1), 16, num_classes=10), _image((1, 3, 56, 56))


# --------------------------------------------------------------------------- dcgan

def dcgan(size: str = "small"):
    """DCGAN generator: z ``(1, 100, 1, 1)`` -> ConvTranspose2d/BN/ReLU stack -> tanh image.

    paper: ngf 64, 3x64x64; small: ngf 16, 3x32x32.
    """
    _check_size(size)
    torch, nn = _torch()
    nz = 100
    ngf, n_up = (64, 4) if size == "paper" else (16, 3)

    torch.manual_seed(0)
    layers = []
    ch = ngf * 2 ** (n_up - 1)
    layers += [nn.ConvTranspose2d(nz, ch, 4, 1, 0, bias=False), nn.BatchNorm2d(ch), nn.ReLU()]
    for _ in range(n_up - 1):
        layers += [nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch // 2),
                   nn.ReLU()]
        ch //= 2
    layers += [nn.ConvTranspose2d(ch, 3, 4, 2, 1, bias=False), nn.Tanh()]

    model = _finish(nn.Sequential(*layers))
    return model, _image((1, nz, 1, 1))


# --------------------------------------------------------------------------- nasnet

def nasnet(size: str = "small"):
    """NASNet-A (mobile-like): normal and reduction cells of separable convs, 3x3 avg/max
    pools, adds and a concat per cell.

    paper: 224x224, 44 filters, 4 normal cells per stage, two stem reduction cells (the
    NASNet-A Mobile layout); small: 32x32, 8 filters, 1 normal cell per stage, one stem
    reduction cell. Simplification: the previous cell's output is aligned with a strided
    1x1 conv (not NASNet's factorised reduction).
    """
    _check_size(size)
    torch, nn = _torch()
    if size == "paper":
        hw, filters, per_stage, stem_red, stem_ch, classes = 224, 44, 4, 2, 32, 1000
    else:
        hw, filters, per_stage, stem_red, stem_ch, classes = 32, 8, 1, 1, 8, 10

    class Sep(nn.Module):
        """relu-depthwise-pointwise-bn, twice (NASNet's separable conv)."""

        def __init__(self, cin, cout, k, stride=1):
            super().__init__()
            p = k // 2
            self.op = nn.Sequential(
                nn.ReLU(), nn.Conv2d(cin, cin, k, stride, p, groups=cin, bias=False),
                nn.Conv2d(cin, cin, 1, bias=False), nn.BatchNorm2d(cin),
                nn.ReLU(), nn.Conv2d(cin, cin, k, 1, p, groups=cin, bias=False),
                nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return self.op(x)

    def adjust(cin, cout, stride=1):
        return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 1, stride, bias=False),
                             nn.BatchNorm2d(cout))

    def avg(stride=1):
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)

    def mx(stride=1):
        return nn.MaxPool2d(3, stride, 1)

    class Normal(nn.Module):
        def __init__(self, c_prev, c_cur, f, prev_reduced):
            super().__init__()
            self.prev = adjust(c_prev, f, 2 if prev_reduced else 1)
            self.cur = adjust(c_cur, f)
            self.s3a, self.s3b, self.s3c = Sep(f, f, 3), Sep(f, f, 3), Sep(f, f, 3)
            self.s5a, self.s5b = Sep(f, f, 5), Sep(f, f, 5)
            self.pa, self.pb, self.pc = avg(), avg(), avg()
            self.out_ch = 6 * f

        def forward(self, prev, cur):
            p, c = self.prev(prev), self.cur(cur)
            b1 = self.s3a(c) + c
            b2 = self.s3b(p) + self.s5a(c)
            b3 = self.pa(c) + p
            b4 = self.pb(p) + self.pc(p)
            b5 = self.s5b(p) + self.s3c(p)
            return torch.cat([p, b1, b2, b3, b4, b5], 1)

    class Reduction(nn.Module):
        def __init__(self, c_prev, c_cur, f, prev_reduced):
            super().__init__()
            self.prev = adjust(c_prev, f, 2 if prev_reduced else 1)
            self.cur = adjust(c_cur, f)
            self.c5, self.p7a, self.p7b, self.p5 = (Sep(f, f, 5, 2), Sep(f, f, 7, 2),
                                                    Sep(f, f, 7, 2), Sep(f, f, 5, 2))
            self.s3 = Sep(f, f, 3)
            self.m1, self.m2, self.a1, self.a2 = mx(2), mx(2), avg(2), avg()
            self.out_ch = 4 * f

        def forward(self, prev, cur):
            p, c = self.prev(prev), self.cur(cur)
            b1 = self.c5(c) + self.p7a(p)
            b2 = self.m1(c) + self.p7b(p)
            b3 = self.a1(c) + self.p5(p)
            b4 = self.a2(b1) + b2
            b5 = self.s3(b1) + self.m2(c)
            return torch.cat([b2, b3, b4, b5], 1)

    class NasNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, stem_ch, 3, 2, 1, bias=False),
                                      nn.BatchNorm2d(stem_ch))
            cells = []
            c_prev, c_cur, prev_reduced = stem_ch, stem_ch, False
            plan = [("R", max(filters // 2 ** (stem_red - i), 1)) for i in range(stem_red)]
            for stage in range(3):
                plan += [("N", filters * 2 ** stage)] * per_stage
                if stage < 2:
                    plan.append(("R", filters * 2 ** (stage + 1)))
            for kind, f in plan:
                cls = Reduction if kind == "R" else Normal
                cell = cls(c_prev, c_cur, f, prev_reduced)
                cells.append(cell)
                c_prev, c_cur, prev_reduced = c_cur, cell.out_ch, kind == "R"
            self.cells = nn.ModuleList(cells)
            self.fc = nn.Linear(c_cur, classes)

        def forward(self, x):
            prev = cur = self.stem(x)
            for cell in self.cells:
                prev, cur = cur, cell(prev, cur)
            return self.fc(torch.relu(cur).mean((2, 3)))

    torch.manual_seed(0)
    return _finish(NasNet()), _image((1, 3, hw, hw))


# --------------------------------------------------------------------------- resnet3d

def resnet3d(size: str = "small"):
    """3D ResNet-50 for video (:func:`resnet` with ``dims=3``): Conv3d bottlenecks, stride 2
    in time and space per stage.

    paper: layers (3, 4, 6, 3), width 64, input ``(1, 3, 16, 112, 112)``;
    small: layers (1, 1, 1, 1), width 8, input ``(1, 3, 4, 32, 32)``.
    """
    _check_size(size)
    if size == "paper":
        layers, width, shape, classes = (3, 4, 6, 3), 64, (1, 3, 16, 112, 112), 400
    else:
        layers, width, shape, classes = (1, 1, 1, 1), 8, (1, 3, 4, 32, 32), 10
    return resnet(layers, width, classes, dims=3), _image(shape)


# --------------------------------------------------------------------------- resnext50

def resnext50(size: str = "small"):
    """ResNeXt-50 32x4d (:func:`resnet` with ``groups=32``): bottlenecks whose 3x3 conv is
    grouped, a mean over the spatial axes before the classifier.

    paper: layers (3, 4, 6, 3), 32x4d, 224x224; small: layers (1, 1), 32x1d, 56x56.
    """
    _check_size(size)
    if size == "paper":
        layers, gw, base, hw, classes = (3, 4, 6, 3), 4, 64, 224, 1000
    else:
        layers, gw, base, hw, classes = (1, 1), 1, 16, 56, 10
    return (resnet(layers, base, classes, groups=32, group_width=gw, head="mean"),
            _image((1, 3, hw, hw)))


# --------------------------------------------------------------------------- inception_v3

def inception_v3(size: str = "small"):
    """Inception-v3 (torchvision layout): stem, InceptionA x3, B (reduction), C x4 (7x1/1x7
    factorised), D (reduction), E x2, global pool, fc. Branches joined by concat.

    paper: full widths, 299x299; small: widths / 8, one A, C and E block, 75x75 (the
    smallest input the stem accepts).
    """
    _check_size(size)
    torch, nn = _torch()
    if size == "paper":
        w, n_a, n_c, n_e, hw, classes = 1.0, 3, 4, 2, 299, 1000
    else:
        w, n_a, n_c, n_e, hw, classes = 0.125, 1, 1, 1, 75, 10

    def ch(c):
        return max(int(c * w), 4)

    class Conv(nn.Module):
        def __init__(self, cin, cout, k, stride=1, padding=0):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, k, stride, padding, bias=False)
            self.bn = nn.BatchNorm2d(cout, eps=0.001)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))

    def pool3(x):
        return nn.functional.avg_pool2d(x, 3, 1, 1)

    class A(nn.Module):
        def __init__(self, cin, pool_ch):
            super().__init__()
            self.b1 = Conv(cin, ch(64), 1)
            self.b5 = nn.Sequential(Conv(cin, ch(48), 1), Conv(ch(48), ch(64), 5, padding=2))
            self.b3 = nn.Sequential(Conv(cin, ch(64), 1), Conv(ch(64), ch(96), 3, padding=1),
                                    Conv(ch(96), ch(96), 3, padding=1))
            self.bp = Conv(cin, pool_ch, 1)
            self.out_ch = ch(64) + ch(64) + ch(96) + pool_ch

        def forward(self, x):
            return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(pool3(x))], 1)

    class B(nn.Module):  # grid reduction 35 -> 17
        def __init__(self, cin):
            super().__init__()
            self.b3 = Conv(cin, ch(384), 3, 2)
            self.bd = nn.Sequential(Conv(cin, ch(64), 1), Conv(ch(64), ch(96), 3, padding=1),
                                    Conv(ch(96), ch(96), 3, 2))
            self.out_ch = ch(384) + ch(96) + cin

        def forward(self, x):
            return torch.cat([self.b3(x), self.bd(x), nn.functional.max_pool2d(x, 3, 2)], 1)

    class C(nn.Module):
        def __init__(self, cin, c7):
            super().__init__()
            self.b1 = Conv(cin, ch(192), 1)
            self.b7 = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (1, 7), padding=(0, 3)),
                                    Conv(c7, ch(192), (7, 1), padding=(3, 0)))
            self.bd = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                    Conv(c7, c7, (1, 7), padding=(0, 3)),
                                    Conv(c7, c7, (7, 1), padding=(3, 0)),
                                    Conv(c7, ch(192), (1, 7), padding=(0, 3)))
            self.bp = Conv(cin, ch(192), 1)
            self.out_ch = 4 * ch(192)

        def forward(self, x):
            return torch.cat([self.b1(x), self.b7(x), self.bd(x), self.bp(pool3(x))], 1)

    class D(nn.Module):  # grid reduction 17 -> 8
        def __init__(self, cin):
            super().__init__()
            self.b3 = nn.Sequential(Conv(cin, ch(192), 1), Conv(ch(192), ch(320), 3, 2))
            self.b7 = nn.Sequential(Conv(cin, ch(192), 1),
                                    Conv(ch(192), ch(192), (1, 7), padding=(0, 3)),
                                    Conv(ch(192), ch(192), (7, 1), padding=(3, 0)),
                                    Conv(ch(192), ch(192), 3, 2))
            self.out_ch = ch(320) + ch(192) + cin

        def forward(self, x):
            return torch.cat([self.b3(x), self.b7(x), nn.functional.max_pool2d(x, 3, 2)], 1)

    class E(nn.Module):
        def __init__(self, cin):
            super().__init__()
            self.b1 = Conv(cin, ch(320), 1)
            self.b3 = Conv(cin, ch(384), 1)
            self.b3a = Conv(ch(384), ch(384), (1, 3), padding=(0, 1))
            self.b3b = Conv(ch(384), ch(384), (3, 1), padding=(1, 0))
            self.bd = nn.Sequential(Conv(cin, ch(448), 1), Conv(ch(448), ch(384), 3, padding=1))
            self.bda = Conv(ch(384), ch(384), (1, 3), padding=(0, 1))
            self.bdb = Conv(ch(384), ch(384), (3, 1), padding=(1, 0))
            self.bp = Conv(cin, ch(192), 1)
            self.out_ch = ch(320) + 4 * ch(384) + ch(192)

        def forward(self, x):
            y3, yd = self.b3(x), self.bd(x)
            return torch.cat([self.b1(x), self.b3a(y3), self.b3b(y3), self.bda(yd),
                              self.bdb(yd), self.bp(pool3(x))], 1)

    class Inception(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(
                Conv(3, ch(32), 3, 2), Conv(ch(32), ch(32), 3), Conv(ch(32), ch(64), 3, padding=1),
                nn.MaxPool2d(3, 2), Conv(ch(64), ch(80), 1), Conv(ch(80), ch(192), 3),
                nn.MaxPool2d(3, 2))
            blocks, c = [], ch(192)
            for i in range(n_a):
                blocks.append(A(c, ch(32) if i == 0 else ch(64)))
                c = blocks[-1].out_ch
            blocks.append(B(c))
            c = blocks[-1].out_ch
            for i in range(n_c):
                c7 = ch((128, 160, 160, 192)[min(i, 3)])
                blocks.append(C(c, c7))
                c = blocks[-1].out_ch
            blocks.append(D(c))
            c = blocks[-1].out_ch
            for _ in range(n_e):
                blocks.append(E(c))
                c = blocks[-1].out_ch
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(c, classes)

        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    torch.manual_seed(0)
    return _finish(Inception()), _image((1, 3, hw, hw))


# --------------------------------------------------------------------------- squeezenet

def squeezenet(size: str = "small"):
    """SqueezeNet 1.1: fire modules (squeeze 1x1, expand 1x1 and 3x3 joined by concat),
    ceil-mode max pools, conv classifier and global average pool.

    paper: 224x224, 1000 classes; small: the same layers on 64x64, 10 classes.
    """
    _check_size(size)
    torch, nn = _torch()
    hw, classes = (224, 1000) if size == "paper" else (64, 10)

    class Fire(nn.Module):
        def __init__(self, cin, sq, e1, e3):
            super().__init__()
            self.sq = nn.Conv2d(cin, sq, 1)
            self.e1, self.e3 = nn.Conv2d(sq, e1, 1), nn.Conv2d(sq, e3, 3, padding=1)

        def forward(self, x):
            s = torch.relu(self.sq(x))
            return torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)

    class SqueezeNet(nn.Module):
        def __init__(self):
            super().__init__()
            pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
            self.features = nn.Sequential(
                nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool(),
                Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
                Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(),
                Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256), Fire(512, 64, 256, 256))
            self.classifier = nn.Conv2d(512, classes, 1)

        def forward(self, x):
            y = torch.relu(self.classifier(self.features(x)))
            return torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1)

    torch.manual_seed(0)
    return _finish(SqueezeNet()), _image((1, 3, hw, hw))


# --------------------------------------------------------------------------- IOS's models

def randwire(size: str = "small"):
    """RandWire (Xie et al., 2019; one of IOS's models): stages of a random graph
    (Watts-Strogatz, k=4, p=0.75, seeded) whose nodes each sum their inputs with learned
    positive weights, then relu, a 3x3 separable convolution and batch norm; a node with no
    predecessor reads the stage's input (stride 2), the stage's output averages its nodes
    with no successor. Many nodes of one stage are independent: what a concurrent schedule
    runs side by side.

    paper: 224x224, the small regime (C=78, 32 nodes a stage, 3 random stages after a conv
    stem); small: 32x32, C=8, 8 nodes a stage.
    """
    _check_size(size)
    torch, nn = _torch()
    import random

    hw, ch, nodes = (224, 78, 32) if size == "paper" else (32, 8, 8)

    def ws_dag(n: int, seed: int) -> list:
        """Predecessors of each node of a Watts-Strogatz graph made acyclic by node order."""
        rng = random.Random(seed)
        edges = set()
        for i in range(n):
            for j in (1, 2):  # k=4: two neighbours each side
                edges.add(tuple(sorted((i, (i + j) % n))))
        rewired = set()
        for a, b in sorted(edges):
            if rng.random() < 0.75:
                c = rng.randrange(n)
                while c == a or tuple(sorted((a, c))) in rewired:
                    c = rng.randrange(n)
                rewired.add(tuple(sorted((a, c))))
            else:
                rewired.add((a, b))
        return [sorted(a for a, b in rewired if b == i) for i in range(n)]

    class Sep(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.dw = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
            self.pw = nn.Conv2d(cin, cout, 1, bias=False)
            self.bn = nn.BatchNorm2d(cout)

        def forward(self, x):
            return self.bn(self.pw(self.dw(torch.relu(x))))

    class Stage(nn.Module):
        def __init__(self, cin, cout, seed):
            super().__init__()
            self.preds = ws_dag(nodes, seed)
            self.ops = nn.ModuleList(Sep(cin if not p else cout, cout, 2 if not p else 1)
                                     for p in self.preds)
            self.weights = nn.ParameterList(nn.Parameter(torch.zeros(max(len(p), 1)))
                                            for p in self.preds)
            used = {a for p in self.preds for a in p}
            self.outs = [i for i in range(nodes) if i not in used]

        def forward(self, x):
            out = []
            for i, (p, op, w) in enumerate(zip(self.preds, self.ops, self.weights)):
                if not p:
                    out.append(op(x))
                    continue
                g = torch.sigmoid(w)
                agg = out[p[0]] * g[0]
                for k, a in enumerate(p[1:], 1):
                    agg = agg + out[a] * g[k]
                out.append(op(agg))
            y = out[self.outs[0]]
            for i in self.outs[1:]:
                y = y + out[i]
            return y / len(self.outs)

    class RandWire(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, ch // 2, 3, 2, 1, bias=False),
                                      nn.BatchNorm2d(ch // 2), nn.ReLU(),
                                      nn.Conv2d(ch // 2, ch, 3, 2, 1, bias=False),
                                      nn.BatchNorm2d(ch))
            self.stages = nn.Sequential(Stage(ch, ch, 1), Stage(ch, 2 * ch, 2),
                                        Stage(2 * ch, 4 * ch, 3))
            self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(4 * ch, 1280, 1), nn.ReLU())
            self.fc = nn.Linear(1280, 1000 if size == "paper" else 10)

        def forward(self, x):
            return self.fc(self.head(self.stages(self.stem(x))).mean((2, 3)))

    torch.manual_seed(0)
    return _finish(RandWire()), _image((1, 3, hw, hw))


def detection_head(size: str = "small"):
    """A RetinaNet-style detector's multi-branch part: a small backbone and FPN give five
    feature levels (strides 8 to 128); on each level a classification subnet and a box
    subnet (four 3x3 conv + relu each, then the class / box conv), weights shared across
    levels as RetinaNet's are. The ten subnet chains are independent of each other: what a
    concurrent schedule runs side by side. Outputs: the class and box maps, flattened and
    concatenated over the levels.

    paper: 384x384 input, 128 channels, 9 anchors, 80 classes (RetinaNet's head at half its
    width and a smaller image, for a 2-core CPU); small: 64x64, 16 channels, 3 anchors, 4
    classes.
    """
    _check_size(size)
    torch, nn = _torch()
    hw, ch, anchors, classes = (384, 128, 9, 80) if size == "paper" else (64, 16, 3, 4)

    def conv(cin, cout, stride=1):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.ReLU())

    def subnet(out):
        return nn.Sequential(*[conv(ch, ch) for _ in range(4)], nn.Conv2d(ch, out, 3, 1, 1))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            # backbone: stride 2, 4, 8 then the FPN's levels 3-7 by stride-2 convs
            self.backbone = nn.Sequential(conv(3, ch // 4, 2), conv(ch // 4, ch // 2, 2),
                                          conv(ch // 2, ch, 2))
            self.down = nn.ModuleList(conv(ch, ch, 2) for _ in range(4))
            self.cls = subnet(anchors * classes)
            self.box = subnet(anchors * 4)

        def forward(self, x):
            levels = [self.backbone(x)]
            for d in self.down:
                levels.append(d(levels[-1]))
            cls = torch.cat([self.cls(f).flatten(1) for f in levels], 1)
            box = torch.cat([self.box(f).flatten(1) for f in levels], 1)
            return cls, box

    torch.manual_seed(0)
    return _finish(Head()), _image((1, 3, hw, hw))


# IOS's multi-branch models beside the zoo's nasnet and inception_v3 (issue #80's figures):
# name -> build(size), as ``ZOO``.
IOS = {"randwire": randwire, "detection_head": detection_head}


# --------------------------------------------------------------------------- registry

# The paper's models: name -> build(size) -> (torch.nn.Module, example_input).
ZOO = {
    "bert": bert,
    "dcgan": dcgan,
    "nasnet": nasnet,
    "resnet3d": resnet3d,
    "resnext50": resnext50,
    "resnet50": resnet50,
    "inception_v3": inception_v3,
    "squeezenet": squeezenet,
}

# Names of one zoo model at one size: name -> (zoo name, size). They ignore a size given.
FIXED = {
    "resnet_small": ("resnet50", "small"),
    "bert_small": ("bert", "small"),
    "bert_base": ("bert", "paper"),
}

# The documented example-input shapes, per size (checked by the tests).
SHAPES = {
    "bert": {"small": (1, 32), "paper": (1, 128)},
    "dcgan": {"small": (1, 100, 1, 1), "paper": (1, 100, 1, 1)},
    "nasnet": {"small": (1, 3, 32, 32), "paper": (1, 3, 224, 224)},
    "resnet3d": {"small": (1, 3, 4, 32, 32), "paper": (1, 3, 16, 112, 112)},
    "resnext50": {"small": (1, 3, 56, 56), "paper": (1, 3, 224, 224)},
    "resnet50": {"small": (1, 3, 56, 56), "paper": (1, 3, 224, 224)},
    "inception_v3": {"small": (1, 3, 75, 75), "paper": (1, 3, 299, 299)},
    "squeezenet": {"small": (1, 3, 64, 64), "paper": (1, 3, 224, 224)},
}


def names() -> list[str]:
    """The paper's models (``ZOO``), in the paper's order."""
    return list(ZOO)


def known() -> list[str]:
    """Every name ``get`` and ``export_onnx`` accept: the zoo's, then ``FIXED``'s."""
    return names() + list(FIXED)


def resolve(name: str, size: str = "small") -> tuple:
    """``(zoo name, size)`` of ``name`` at ``size`` (a ``FIXED`` name has its own size)."""
    _check_size(size)
    if name in FIXED:
        return FIXED[name]
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}: expected one of {known()}")
    return name, size


def get(name: str, size: str = "small"):
    """``(torch.nn.Module, example_input)`` for model ``name`` at ``size``."""
    name, size = resolve(name, size)
    return ZOO[name](size)


def export_onnx(name: str, size: str, path: str | None = None) -> str:
    """Write model ``name`` at ``size`` to ``path`` as ONNX; ``export_onnx(name, path)``
    exports it at the default size (``small``; a ``FIXED`` name at its own). Returns ``path``.

    Opset 17, traced on the model's example input, one input ``"input"`` and one output
    ``"output"``. The IR version is capped at 10: onnx 1.23 writes 14 by default and
    onnxruntime 1.31 reads at most 13.
    """
    if path is None:
        size, path = "small", size
    from ..frontend.model_file import export_torch

    model, x = get(name, size)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return export_torch(model, (x,), path, input_names=["input"], output_names=["output"])
