"""``collage-tvm``: optimize a model, run a saved build, inspect the cost DB."""
# (this docstring is the command line's description: _parser's description=__doc__)
from __future__ import annotations

import argparse


LEAN_HELP = ("measure only the candidates the op-level DP can still choose (default): the "
             "single heavy operators on each library first, then what the DP picks on lower "
             "bounds from those and from each backend's best measured rates, until the "
             "measured cover is within 30%% of the DP's answer on lower bounds (placer.lean); "
             "--no-lean: measure every candidate, as the paper does")
ACCURACY_HELP = ("accuracy budget: f32 (default: strict, every candidate f32), bf16 (bf16 "
                 "variants of the named libraries too, e.g. openvino_bf16, where the CPU has "
                 "bf16 instructions; the build's error within 2e-2 of the output scale, checked "
                 "against f32 on random inputs), int8 (Collage quantizes the f32 ONNX model with "
                 "accuracy control, within 5e-2 of the output scale, or int8:TOL, and ships it "
                 "where it beats the float build; --calibration) or a tolerance such as 0.05 "
                 "(bf16 allowed from 1e-2)")
BUILD_JOBS_HELP = ("processes that build the TVM candidates before they are timed (default: "
                   "one per core on a GPU target or a CPU of 8 cores and more, else 0: each "
                   "is built where it is timed)")


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 0, got {text!r}")
    return n


def _optimize_parser(sub) -> None:
    """The ``optimize`` verb: search a placement for a model and build it."""
    from ..options import DEFAULT_BUDGET, SCHEDULES

    o = sub.add_parser("optimize", help="search a placement for a model and build it")
    o.add_argument("model", help="an .onnx file")
    o.add_argument("--target", default="llvm",
                   help="llvm (this CPU, default), cuda (this machine's GPU) or cuda:sm_90")
    o.add_argument("--backends", default="",
                   help="comma-separated (default: every backend for the target that loads "
                        "here); built in: tvm, dnnl, mkl, onnxruntime, openvino; on a cuda "
                        "target: tvm, cudnn, cublas, inductor (tensorrt: patterns only, not "
                        "runnable here)")
    o.add_argument("--db", default=None, help="cost DB path (default ~/.cache/collage-tvm/costs.db)")
    o.add_argument("--patterns", action="append", help="extra pattern file (repeatable)")
    o.add_argument("--input-shape", action="append", metavar="NAME=D1xD2x...",
                   help="one static shape of an input with dynamic dimensions (batch, "
                        "sequence), e.g. input=1x3x224x224 (repeatable): the build serves "
                        "that shape alone")
    o.add_argument("--report", metavar="FILE.json",
                   help="also write the build's report as JSON: what ran where, the final "
                        "check's table, the search's figures, the machine")
    o.add_argument("--shapes", action="append", metavar="NAME=MIN:OPT:MAX",
                   help="the range of shapes an input with dynamic dimensions is built for, "
                        "as TensorRT's profiles: e.g. input_ids=1x1:1x128:8x512 (searched at "
                        "OPT, served from MIN to MAX; repeatable). Default: read from the "
                        "model (batch 1..8 around 1; a sequence 1..its positions around 128)")
    o.add_argument("--shape-weights", metavar="FILE",
                   help="the shapes a server saw, one a line with a count (input_ids=4x37 "
                        "120), or JSON {\"input_ids=4x37\": 120}: default ranges widened to "
                        "them, the optimum at the heaviest, the expected cost per call "
                        "weighted by them")
    o.add_argument("--inputs", metavar="FILE.npz",
                   help="example inputs (an .npz keyed by input name, or one .npy): every "
                        "build is checked and timed on them first; for a model whose inputs "
                        "shape the computation (a slice's bounds, a range's limits)")
    o.add_argument("--output", "-o", help="write the placement JSON here")
    o.add_argument("--export", metavar="DIR",
                   help="save the build as a directory that `collage-tvm run DIR` or "
                        "collage_tvm.load(DIR) runs in another process without searching "
                        "(TVM's kernels, each library's region, a manifest)")
    o.add_argument("--no-compare", action="store_true",
                   help="skip the never-slower check (the placement timed end to end beside "
                        "every single-backend build and the model file run whole by each "
                        "graph library; the fastest correct one ships)")
    o.add_argument("--graph-level", action=argparse.BooleanOptionalAction, default=True,
                   help="after the op-level DP, run the evolutionary graph-level placer over the "
                        "graph libraries among --backends (onnxruntime, openvino); on by "
                        "default, --no-graph-level turns it off")
    o.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help=LEAN_HELP)
    o.add_argument("--rewrite", action="store_true",
                   help="before placement, apply the z3-verified graph rewrites "
                        "(collage_tvm.rewrite): a convolution's per-channel affine tail (e.g. "
                        "a batch norm) folded into its weights, then a cost-based search over "
                        "sibling convolution/matmul merges, convolutions split over a concat "
                        "and the generator's proved add/mul/matmul/transpose/relu "
                        "substitutions, each graph costed on --backends")
    o.add_argument("--calibrate", type=int, default=4, metavar="ROUNDS",
                   help="rounds of in-context calibration of the op-level placement: run it, "
                        "re-cost each external group as timed in place, re-run the DP "
                        "(default 4; 0 turns it off)")
    o.add_argument("--refine", type=int, default=2, metavar="ROUNDS",
                   help="rounds of side-by-side re-timing of the op-level placement's "
                        "alternative covers (within 75%% of the chosen one's measured "
                        "cost), each followed by a DP re-run (default 2; 0 turns it off)")
    o.add_argument("--no-switching", action="store_true",
                   help="op-level DP with the paper's additive cost (no measured cost of "
                        "changing runtime between consecutive kernels)")
    o.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="time budget in seconds of the graph-level search and of the rewrite "
                        f"search, each (default {DEFAULT_BUDGET:.0f})")
    o.add_argument("--in-process", action="store_true",
                   help="measure in this process (faster start, no crash isolation)")
    o.add_argument("--accuracy", default="f32", metavar="BUDGET", help=ACCURACY_HELP)
    o.add_argument("--schedule", dest="schedule_mode", choices=SCHEDULES, default="auto",
                   help="independent regions run at the same time, each on its share of the "
                        "cores (issue #80, experimental): auto (default: the placement's "
                        "schedule is planned from measured stages and its build ships only "
                        "when the final check times it faster), concurrent (ship it whenever "
                        "the plan has a concurrent stage), sequential (plan none)")
    o.add_argument("--calibration", metavar="FILE.npz",
                   help="--accuracy int8: the inputs the quantization is calibrated on, keyed "
                        "by input name (each array one input, or N of them stacked); default: "
                        "8 random inputs, which the report says")
    o.add_argument("--build-jobs", type=_jobs, default=None, metavar="N", help=BUILD_JOBS_HELP)
    o.add_argument("--rpc-tracker", default="", metavar="HOST:PORT",
                   help="measure the candidates on the TVM RPC servers registered at this "
                        "tracker under --rpc-key (each started with python -m "
                        "collage_tvm.measure.remote --tracker HOST:PORT --key KEY; "
                        "docs/GUIDE.md, \"Measuring on other machines\")")
    o.add_argument("--rpc-key", default="", metavar="KEY",
                   help="the servers' key at --rpc-tracker")
    o.add_argument("--no-tuning", action="store_true",
                   help="build TVM's kernels untuned, even where `collage-tvm tune` has "
                        "records for them")
    o.add_argument("-v", "--verbose", action="store_true")


def _tune_parser(sub) -> None:
    """The ``tune`` verb."""
    t = sub.add_parser("tune", help="tune (MetaSchedule) the TVM kernels a model's placement "
                                    "could use; later builds apply the records")
    t.add_argument("model", help="an .onnx file")
    t.add_argument("--target", default="llvm")
    t.add_argument("--backends", default="tvm,dnnl",
                   help="the backends optimize will use (default tvm,dnnl): their measured "
                        "costs decide which TVM kernels are worth tuning")
    t.add_argument("--budget", type=float, default=600.0,
                   help="seconds of tuning this model gets, earlier tunes of it included "
                        "(default 600: running the same command again tunes nothing; a "
                        "larger budget tunes more; measuring the candidates is not counted)")
    t.add_argument("--trials", type=int, default=64,
                   help="at most this many schedules measured per kernel (default 64)")
    t.add_argument("--db", default=None, help="cost DB path (default ~/.cache/collage-tvm/costs.db)")
    t.add_argument("--tuning-db", default=None,
                   help="tuning database directory (default: next to the cost DB, one per "
                        "target: <db>.tuning/<cpu>-<id>)")
    t.add_argument("--input-shape", action="append", metavar="NAME=D1xD2x...")
    t.add_argument("--in-process", action="store_true")
    t.add_argument("--rewrite", action="store_true",
                   help="tune the graph the verified rewrites give (as optimize --rewrite "
                        "places it)")
    t.add_argument("-v", "--verbose", action="store_true")


def _bench_parser(sub) -> None:
    """The ``bench`` verb."""
    from ..options import DEFAULT_BUDGET

    b = sub.add_parser("bench", help="Collage beside the frameworks a user would run instead "
                       "(ONNX Runtime, OpenVINO f32 and default precision, PyTorch) and its "
                       "own single-backend builds, on zoo models or an external --suite")
    b.add_argument("models", nargs="*", help="model names: the zoo (collage_tvm.tools.zoo: bert, "
                   "dcgan, nasnet, resnet3d, resnext50, resnet50, inception_v3, squeezenet) "
                   "or resnet_small, bert_base, bert_small")
    b.add_argument("--all", action="store_true", help="every zoo model")
    _suite_arguments(b)
    b.add_argument("--size", choices=["small", "paper"], default="paper",
                   help="zoo model size (default paper)")
    b.add_argument("--backends", default="tvm,dnnl,mkl,onnxruntime,openvino",
                   help="(on --target cuda: e.g. tvm,cudnn,cublas)")
    b.add_argument("--target", default="llvm",
                   help="llvm (this CPU, default) or cuda (this machine's GPU: the "
                        "frameworks are PyTorch eager, torch.compile and torch.compile with "
                        "CUDA graphs on it; docs/GPU.md)")
    b.add_argument("--graph-level", action=argparse.BooleanOptionalAction, default=True,
                   help="the two-level search, as optimize runs it by default "
                        "(--no-graph-level: the op level alone)")
    b.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="seconds of graph-level search and of rewrite search, each (default "
                        f"{DEFAULT_BUDGET:.0f}; a suite gives each model at most 120)")
    b.add_argument("--db", default=None)
    b.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help=LEAN_HELP)
    b.add_argument("--rewrite", action="store_true",
                   help="also Collage placed-only beside rewritten+placed (the z3-verified "
                        "graph rewrites, collage_tvm.rewrite), timed interleaved, outputs "
                        "checked against placed-only")
    b.add_argument("--accuracy", default="f32", metavar="BUDGET",
                   help=ACCURACY_HELP + "; with a torch --suite, the rows also judge Collage "
                   "against OpenVINO at its default precision and go to suite_<name>_<budget>"
                   ".json")
    b.add_argument("--build-jobs", type=_jobs, default=None, metavar="N", help=BUILD_JOBS_HELP)
    b.add_argument("--deploy", action="store_true",
                   help="also save each shipped build (collage_tvm.save), load it in a fresh "
                        "process beside creating an ONNX Runtime session for the same file, "
                        "check its outputs against the in-process build's, and time both "
                        "interleaved (results.json: \"deploy\")")
    b.add_argument("--torch-compile", action="store_true",
                   help="instead of the zoo: torch.compile(model, backend=\"collage\") in a "
                        "fresh process (searching; a fresh cost DB unless --db), then again in "
                        "a second one (placement from the log), each checked against eager "
                        "and timed beside it; models: resnet18 (torchvision, 224x224), "
                        "bert_break (a 4-layer BERT-base-wide encoder, a graph break); "
                        "writes torch_compile.json")
    b.add_argument("--tune", type=float, default=0.0, metavar="SECONDS",
                   help="first tune each model's TVM kernels for SECONDS (collage-tvm tune; "
                        "a warm tuning DB makes it quick), then also time the search with "
                        "untuned TVM beside tuned TVM, interleaved, outputs checked")
    b.add_argument("--ablation", action="store_true",
                   help="also run Collage with --backends added one at a time in their order "
                        "(tvm; tvm,dnnl; ...: paper Fig. 11), the steps timed interleaved")
    b.add_argument("--out", default="bench-out",
                   help="folder for results.json / results.md / results.png (the plots need "
                        "matplotlib: pip install 'collage-tvm[plot]')")
    b.add_argument("-v", "--verbose", action="store_true")


def _suite_arguments(b) -> None:
    """``bench``'s arguments of an external ``--suite`` run."""
    from ..tools.suites import SUITES

    b.add_argument("--suite", choices=SUITES,
                   help="an external model suite instead of zoo models: the onnx wheel's "
                        "backend test models (node tests; pytorch-converted, pytorch-operator "
                        "and simple files), transformers models built from configs, every "
                        "torchvision classification, segmentation or video model, or 57 timm "
                        "architectures; writes suite_<name>.json/.md. A torch suite's model is "
                        "exported to ONNX, searched, and its shipped Collage build timed "
                        "interleaved in one process beside that ONNX file on ONNX Runtime, on "
                        "OpenVINO at f32 and at its default precision (bf16 on CPUs with bf16 "
                        "instructions) and PyTorch eager, all at one thread per core, each "
                        "checked against PyTorch's outputs; the table gives Collage against "
                        "the best correct f32 framework. Model names given: only those of the "
                        "suite")
    b.add_argument("--input-size", choices=["usual", "small"], default="usual",
                   help="with a torch --suite: usual (default: what a user runs, e.g. "
                        "ImageNet classifiers at 224x224 or their weights' own size, timm at "
                        "its default_cfg input size, transformers at 128 tokens; segmentation "
                        "and video keep their small sizes) or small (quick: 64x64 images, 16 "
                        "tokens)")
    b.add_argument("--dynamic", action="store_true",
                   help="with --suite torchvision, timm or transformers: each model exported "
                        "with dynamic axes (batch; transformers: batch and sequence), built by "
                        "optimize with no flags, saved and loaded, and timed at batch 1, 4, 8 "
                        "(x sequence 8, 32, 128, 512) beside the same dynamic file on each "
                        "framework; writes suite_<name>_dynamic.json/.md")
    b.add_argument("--int8", action="store_true",
                   help="with --suite torchvision or timm: each model quantized as ONNX "
                        "Runtime's docs show (QDQ) and built by optimize with no flags, and "
                        "the f32 model built under --accuracy int8, timed beside ONNX Runtime "
                        "and OpenVINO on the quantized file and OpenVINO's default on the f32 "
                        "file; writes suite_<name>_int8.json/.md")
    b.add_argument("--schedule", action="store_true",
                   help="with --suite torchvision: multi-branch models (googlenet, "
                        "inception_v3, squeezenet1_1 at batch 1 and 4) searched at the op "
                        "level, their placement's concurrent schedule measured (issue #80), "
                        "and the placement built sequentially and concurrently, timed beside the "
                        "frameworks on the same file; writes suite_torchvision_schedule.json/.md")
    b.add_argument("--no-frameworks", action="store_true",
                   help="with a torch --suite: leave out the frameworks (coverage only)")
    b.add_argument("--full", action="store_true",
                   help="with an onnx suite: also the whole Collage search over --backends "
                        "on every case TVM alone runs")
    b.add_argument("--resume", action="store_true",
                   help="with --suite: keep the models an earlier run wrote to "
                        "--out/suite_<name>.json (it is rewritten after every model) and run "
                        "the rest")
    b.add_argument("--again", action="store_true",
                   help="with --suite --resume and model names: run the named models again "
                        "(their earlier rows replaced), keep the others' rows")
    b.add_argument("--limit", type=int, default=None,
                   help="with --suite: the first N models (--graph-level: both levels, at most "
                        "min(--budget, 120) s of graph-level search a model)")


def _run_parser(sub) -> None:
    """The ``run`` verb: a saved build loaded and run."""
    r = sub.add_parser("run", help="load a build saved with optimize --export (or "
                                   "collage_tvm.save) and run it, optionally timing it")
    r.add_argument("artifact", metavar="DIR", help="the directory optimize --export wrote")
    r.add_argument("--inputs", metavar="FILE.npz",
                   help="the inputs: an .npz keyed by input name (or arr_0, arr_1, ...), or "
                        "one .npy for a one-input model (default: random inputs of the saved "
                        "shapes)")
    r.add_argument("--output", "-o", metavar="FILE.npz",
                   help="write the outputs here, keyed by output name")
    r.add_argument("--bench", type=int, default=0, metavar="N",
                   help="then time N runs after warm-up and print the p50/p90/p99 latency")
    r.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="warm-up runs before --bench (default max(3, N/10))")
    r.add_argument("--no-decide", dest="decide", action="store_false",
                   help="where the build holds graph libraries that ran the model (or a "
                        "shape of a dynamic one) within a few percent of each other, keep the "
                        "search's choice rather than letting the first calls race them here")


def _db_parser(sub) -> None:
    """The ``db`` verb."""
    d = sub.add_parser("db", help="inspect, export, import or forget records of the cost DB")
    d.add_argument("action", choices=["stats", "show", "export", "import", "forget"])
    d.add_argument("file", nargs="?")
    d.add_argument("--db", default=None)
    d.add_argument("--limit", type=int, default=50)
    d.add_argument("--backend", default=None, help="forget: only this backend's records")
    d.add_argument("--kind", default=None,
                   help="forget: failed, measured, or one kind of failure: timeout, memory, "
                        "crash (the measuring process died), cannot-run")
    d.add_argument("--label", default=None,
                   help="forget: only candidates whose label contains this (an operator)")


def _show_parser(sub) -> None:
    """The ``show`` verb."""
    s = sub.add_parser("show", help="draw a placement JSON: the dataflow graph coloured by "
                                    "backend, fused groups boxed")
    s.add_argument("placement", help="a placement JSON written by `collage-tvm optimize -o` "
                                     "(drawn), or a saved build's directory (`--export DIR`): "
                                     "what it holds and which backend serves each shape")
    s.add_argument("--output", "-o", help="the picture: .svg, .html (hover for details) or .png "
                                          "(matplotlib: pip install 'collage-tvm[plot]'; "
                                          "default: the JSON's name with .svg)")


def _parser() -> argparse.ArgumentParser:
    """The ``collage-tvm`` command line: one sub-parser per verb."""
    p = argparse.ArgumentParser(prog="collage-tvm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_optimize_parser, _tune_parser, _bench_parser, _run_parser, _db_parser,
                _show_parser):
        add(sub)
    return p
