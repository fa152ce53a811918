"""The fused head kernel (plugins/lowrank_recurrence, OpenAI Triton) against the reference head
``model.sequential_head.recurrence``: on the CPU through TRITON_INTERPRET=1 (on a GPU natively).
Greedy tokens are exact and the written logits match to fp32 rounding; with fixed uniforms the
sampled tokens are deterministic and equal the reference's inverse-CDF samples."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported
pytest.importorskip("triton", reason="needs OpenAI Triton (pip install triton)")

from dlite_trt.export.recurrence import TRT_ABI_SLOTS  # noqa: E402
from dlite_trt.model.sequential_head import SequentialHead, recurrence  # noqa: E402
from plugins.lowrank_recurrence.aot import BLOCK_V, DEFAULT_TACTIC, TACTICS  # noqa: E402
from plugins.lowrank_recurrence.launch import lowrank_recurrence  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (B, K, H, r, V, seed step): V = 300 and 129 are not multiples of the vocabulary tile
    (2, 3, 48, 32, 300, False),
    (1, 7, 64, 16, 129, True),
    (3, 7, 40, 24, 2 * BLOCK_V, True),
    (2, 3, 16, 8, 77, False),
]


def _case(b, k, h, r, v, seed, seed_value=0):
    torch.manual_seed(seed_value)
    head = SequentialHead(v, r, h)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(seed_value + 1)
    hidden = torch.randn(b, k, h, generator=g)
    anchor = torch.randint(0, v, (b,), generator=g)
    seed_prev = torch.randint(0, v, (b,), generator=g) if seed else None
    return head.weights(), hidden, anchor, seed_prev


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-K{}-H{}-r{}-V{}{}".format(*s[:5], "-seed" if s[5] else ""))
@torch.no_grad()
def test_greedy_tokens_exact_and_logits_match(shape):
    w, hidden, anchor, seed_prev = _case(*shape)
    ref = recurrence(w, hidden, anchor, seed_prev, 0.0)
    wd = type(w)(*_to(DEVICE, *w))
    args = _to(DEVICE, hidden, anchor, seed_prev) + [torch.zeros(shape[0], device=DEVICE), None]
    tokens, logits = lowrank_recurrence(wd, *args, write_logits=True)
    assert torch.equal(tokens.cpu(), ref.tokens)
    torch.testing.assert_close(logits.cpu(), ref.logits, rtol=1e-5, atol=1e-5)
    tokens_only, none = lowrank_recurrence(wd, *args, write_logits=False)  # greedy: no logits written
    assert none is None and torch.equal(tokens_only.cpu(), ref.tokens)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "B{}-K{}-V{}".format(s[0], s[1], s[4]))
@torch.no_grad()
def test_sampling_with_fixed_uniforms_equals_the_reference(shape):
    b, k = shape[:2]
    w, hidden, anchor, seed_prev = _case(*shape, seed_value=3)
    g = torch.Generator().manual_seed(7)
    temperature = torch.tensor([0.7, 0.0, 1.3][:b])  # a greedy row among sampling rows
    uniforms = torch.rand(b, k, generator=g)
    ref = recurrence(w, hidden, anchor, seed_prev, temperature, uniforms)
    wd = type(w)(*_to(DEVICE, *w))
    args = _to(DEVICE, hidden, anchor, seed_prev, temperature, uniforms)
    first, logits = lowrank_recurrence(wd, *args, write_logits=True)
    again, _ = lowrank_recurrence(wd, *args, write_logits=True)
    assert torch.equal(first, again)  # deterministic for fixed uniforms
    assert torch.equal(first.cpu(), ref.tokens)
    torch.testing.assert_close(logits.cpu(), ref.logits, rtol=1e-5, atol=1e-5)
    other = torch.rand(b, k, generator=g)
    assert torch.equal(lowrank_recurrence(wd, *args[:4], other.to(DEVICE), write_logits=True)[0].cpu(),
                       recurrence(w, hidden, anchor, seed_prev, temperature, other).tokens)


@pytest.mark.parametrize("tactic", sorted(set(TACTICS) - {DEFAULT_TACTIC}))
@torch.no_grad()
def test_every_tensorrt_tactic_gives_the_reference_tokens(tactic):
    """The plugin's autotuner may pick any tactic (another vocabulary tile, more warps): V = 300
    is no multiple of any tile; greedy and sampled rows, logits to fp32 rounding."""
    b, k = 3, 7
    w, hidden, anchor, seed_prev = _case(b, k, 40, 24, 300, True, seed_value=5)
    temperature = torch.tensor([0.0, 0.8, 1.1])
    uniforms = torch.rand(b, k, generator=torch.Generator().manual_seed(11))
    ref = recurrence(w, hidden, anchor, seed_prev, temperature, uniforms)
    wd = type(w)(*_to(DEVICE, *w))
    tokens, logits = lowrank_recurrence(wd, *_to(DEVICE, hidden, anchor, seed_prev, temperature, uniforms),
                                        write_logits=True, tactic=tactic)
    assert torch.equal(tokens.cpu(), ref.tokens)
    torch.testing.assert_close(logits.cpu(), ref.logits, rtol=1e-5, atol=1e-5)


def test_an_unknown_tactic_is_refused():
    w, hidden, anchor, _ = _case(1, 3, 16, 8, 40, False)
    with pytest.raises(ValueError, match="tactics are"):
        lowrank_recurrence(w, hidden, anchor, None, torch.zeros(1), None, write_logits=False, tactic=99)


def test_sampling_needs_the_logits():
    w, hidden, anchor, _ = _case(1, 3, 16, 8, 40, False)
    with pytest.raises(ValueError, match="write_logits=True"):
        lowrank_recurrence(w, hidden, anchor, None, torch.tensor([0.9]), torch.rand(1, 3), write_logits=False)


@pytest.mark.slow
def test_gpu_check_script_runs_small(tmp_path):
    """build_scripts/gpu_check.py (the GPU machine's one command) at tiny sizes: one JSON line,
    kernel tokens equal to the reference's; its engine comparison (TensorRT against ONNX Runtime
    on a GPU) run against a second ONNX Runtime build."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}
    out = subprocess.run([sys.executable, str(root / "build_scripts/gpu_check.py"), "--small", "--repeat", "2",
                          "--compare-with", "onnxruntime", "--work", str(tmp_path)],
                         capture_output=True, text=True, env=env, check=True, timeout=900)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [k["tokens_equal"] for k in result["kernel"]] == [1.0, 1.0]
    assert result["verify_vs_decode"]["verify_tokens"] == 8 and result["verify_vs_decode"]["decode_ms"] > 0
    engines = result["engines"]
    assert engines["generation"] == {"prompts": 4, "identical": 4, "first_difference": None}
    assert engines["graphs"]["step"]["next_block"] == {"differing": 0, "of": 2 * 8}  # batch 2, [anchor, 7 drafts]
    assert engines["compared"] == "onnxruntime fp32 against onnxruntime fp32"
    assert set(engines["build_s"]) == set(engines["tokens_per_s"]) == {"onnxruntime", "onnxruntime (second build)"}
    assert all(v > 0 for v in engines["tokens_per_s"].values())


@pytest.mark.parametrize(("dtype", "seeded", "sampling", "tactic"),
                         [("float32", True, False, DEFAULT_TACTIC), ("bfloat16", False, True, max(TACTICS))])
def test_ahead_of_time_compiles_to_ptx_without_a_gpu(dtype, seeded, sampling, tactic):
    """What the TensorRT plugin embeds: the kernel compiled for sm_90 at Qwen3-8B's rank (in a
    process without TRITON_INTERPRET: interpreted kernels cannot be compiled)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json; from plugins.lowrank_recurrence.aot import compile_kernel; "
            f"k = compile_kernel({dtype!r}, rank=256, seeded={seeded}, sampling={sampling}, tactic={tactic}, "
            "capability=(9, 0), ptx_version=84); "
            "print(json.dumps({'name': k.metadata.name, 'warps': k.metadata.num_warps, 'ptx': k.asm['ptx']}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=600)
    kernel = json.loads(out.stdout.strip().splitlines()[-1])
    assert f".entry {kernel['name']}" in kernel["ptx"] and ".target sm_90" in kernel["ptx"]
    assert kernel["warps"] == TACTICS[tactic][1]
    assert ".version 8.4" in kernel["ptx"]  # a PTX ISA an older driver loads, not the bundled ptxas's newest
    from plugins.lowrank_recurrence.aot import (
        KERNEL_INPUTS,
        KERNEL_OUTPUTS,
        KERNEL_SCALARS,
        entry_parameters,
    )

    declared = len(KERNEL_INPUTS) + len(KERNEL_SCALARS) + len(KERNEL_OUTPUTS)
    assert declared <= entry_parameters(kernel["ptx"]) <= declared + len(TRT_ABI_SLOTS)  # compile_kernel checked


def test_the_launch_abi_check_refuses_what_tensorrt_cannot_launch():
    """TensorRT passes one pointer per plugin output: more hidden Triton parameters than the
    plugin's ABI slots, or a kernel that needs scratch memory, must stop the build."""
    from types import SimpleNamespace

    from plugins.lowrank_recurrence.aot import check_launch_abi

    def kernel(params: int, **metadata):
        ptx = ".version 8.4\n.entry k(" + ", ".join(f".param .u64 p{i}" for i in range(params)) + ")\n{ ret; }"
        return SimpleNamespace(asm={"ptx": ptx}, metadata=SimpleNamespace(**metadata))

    check_launch_abi(kernel(18))
    check_launch_abi(kernel(20, global_scratch_size=0, profile_scratch_size=0))
    with pytest.raises(RuntimeError, match="3 hidden parameters"):
        check_launch_abi(kernel(21))
    with pytest.raises(RuntimeError, match="global_scratch_size = 64"):
        check_launch_abi(kernel(20, global_scratch_size=64))


def test_plugin_annotations_are_types_for_tensorrt():
    """tensorrt.plugin validates the registered functions' annotations as types: a postponed
    annotations import (strings) would break registration on every TensorRT machine."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "plugins/lowrank_recurrence/trt_plugin.py"
    futures = [a.name for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.ImportFrom)
               and node.module == "__future__" for a in node.names]
    assert "annotations" not in futures


def test_tensorrt_registration_needs_tensorrt():
    pytest.importorskip("plugins.lowrank_recurrence.trt_plugin")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        from dlite_trt.errors import DLiteError
        from plugins.lowrank_recurrence.trt_plugin import register

        with pytest.raises(DLiteError, match=r"install dlite-trt\[trt\] on a machine with an NVIDIA GPU"):
            register()
    else:
        pytest.skip("TensorRT is installed: the registration runs in the tensorrt-marked tests")


def test_the_plugin_is_installed_with_the_package(tmp_path):
    """TensorRT engines need plugins/ wherever dlite-trt is installed, not only in a checkout:
    it imports from outside the repository, with nothing added to the path."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    code = "import plugins.lowrank_recurrence.trt_plugin as p; print(p.PLUGIN_ID)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=True, timeout=120)
    assert out.stdout.strip() == "dlite::LowRankRecurrence"
