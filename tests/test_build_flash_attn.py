"""kernels/build_flash_attn.py without nvcc, and the `auto` backend choice without a GPU.

The real flash-attn 2.8.3 sdist is fetched once from PyPI (8.4 MB, cached in
~/.cache/nanoserve/flash-attn) and patched with --patch-only; the patched setup.py is read
back with `ast` (what setuptools would compile), and the patched dispatch macros are compiled
with the host C++ compiler and run, so a head dim / dtype that was not built must throw.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kernels import build_flash_attn as bfa
from kernels import flash_attn_backend as fab
from kernels.attention import TorchBackend, select_backend
from kernels.backend_choice import AttentionShapes, time_backends


@pytest.fixture(scope="module")
def sdist() -> Path:
    return bfa.fetch_sdist()


def cuda_extension(root: Path) -> dict[str, ast.AST]:
    """Keyword arguments of setup.py's flash_attn_2_cuda CUDAExtension(...), as ast nodes."""
    for node in ast.walk(ast.parse((root / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CUDAExtension":
            kw = {k.arg: k.value for k in node.keywords}
            if ast.literal_eval(kw["name"]) == "flash_attn_2_cuda":
                return kw
    raise AssertionError("no flash_attn_2_cuda CUDAExtension in setup.py")


def setup_sources(root: Path) -> list[str]:
    return ast.literal_eval(cuda_extension(root)["sources"])


def compile_flags(root: Path) -> dict[str, list[str]]:
    """String literals in extra_compile_args["cxx"] / ["nvcc"] (added to variables there)."""
    args = cuda_extension(root)["extra_compile_args"]
    return {ast.literal_eval(k): [n.value for n in ast.walk(v) if isinstance(n, ast.Constant)
                                  and isinstance(n.value, str)]
            for k, v in zip(args.keys, args.values)}


TRIM_ARGS = ["--head-dims", "128,64", "--dtypes", "bf16", "--archs", "90"]


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory, sdist) -> tuple[Path, str]:
    """The sdist patched once with TRIM_ARGS (unpacking is the slow part): (root, stdout)."""
    out = tmp_path_factory.mktemp("fa")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bfa.main(["--patch-only", "--out", str(out), "--cache-dir", str(sdist.parent), *TRIM_ARGS])
    return out / f"flash_attn-{bfa.VERSION}", buf.getvalue()


def test_sdist_is_the_pinned_one(sdist):
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == bfa.SDIST_SHA256
    assert sdist.stat().st_size > 8_000_000


def test_patch_selects_exactly_the_requested_kernels(trimmed):
    root, printed = trimmed
    expected = ["csrc/flash_attn/flash_api.cpp"] + [
        f"csrc/flash_attn/src/flash_{kind}_hdim{d}_bf16{c}_sm80.cu"
        for kind in ("fwd", "fwd_split") for d in (64, 128) for c in ("", "_causal")]
    assert setup_sources(root) == expected
    assert "9 sources, archs 90" in printed and all(s in printed for s in expected)
    flags = compile_flags(root)
    for feature in bfa.DISABLED:          # compiled out for both compilers
        assert all(f"-DFLASHATTENTION_DISABLE_{feature}" in flags[c] for c in ("cxx", "nvcc"))
    record: dict = {}
    exec((root / "flash_attn" / "_nanoserve_build.py").read_text(), record)
    assert (record["HEAD_DIMS"], record["DTYPES"], record["ARCHS"]) == ((64, 128), ("bf16",), ("90",))
    api = (root / "csrc/flash_attn/flash_api.cpp").read_text()
    assert "run_mha_bwd_<" not in api and "does not support backward" in api


def test_default_build_is_qwen3_head_dim_both_dtypes_both_archs():
    spec = bfa.BuildSpec()
    sources = spec.sources()
    assert len(sources) == 9 and all("hdim128" in s for s in sources[1:])
    assert {s.split("_")[-2] for s in sources[1:] if "causal" not in s} == {"bf16", "fp16"}
    assert spec.archs == ("80", "90")


DISPATCH_PROBE = r"""
#include <cstdio>
#include <string>
namespace cutlass { struct half_t {}; struct bfloat16_t {}; }
#include "static_switch.h"
template <typename T> const char *name();
template <> const char *name<cutlass::half_t>() { return "fp16"; }
template <> const char *name<cutlass::bfloat16_t>() { return "bf16"; }
int main() {
  for (int d : {40, 64, 100, 128, 256, 300}) for (bool fp16 : {false, true}) {
    try {
      FP16_SWITCH(fp16, [&] { HEADDIM_SWITCH(d, [&] {
        std::printf("d=%d %s -> kernel %d %s\n", d, fp16 ? "fp16" : "bf16", kHeadDim, name<elem_type>());
      }); });
    } catch (const std::runtime_error &e) {
      std::printf("d=%d %s -> error %s\n", d, fp16 ? "fp16" : "bf16", e.what());
    }
  }
}
"""


def test_patched_dispatch_runs_only_built_kernels(tmp_path, trimmed):
    """Compile the patched FP16/HEADDIM_SWITCH with the host compiler and call every case."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no host C++ compiler (g++) to compile the dispatch probe", pytrace=False)
    root = trimmed[0]
    (tmp_path / "probe.cpp").write_text(DISPATCH_PROBE)
    subprocess.run([cxx, "-std=c++17", "-I", str(root / "csrc/flash_attn/src"), "-o",
                    str(tmp_path / "probe"), str(tmp_path / "probe.cpp")], check=True)
    lines = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    got = {tuple(l.split(" -> ")[0].split()): l.split(" -> ")[1] for l in lines}
    assert got[("d=40", "bf16")] == "kernel 64 bf16"        # rounds up to the 64 bucket
    assert got[("d=64", "bf16")] == "kernel 64 bf16"
    assert got[("d=100", "bf16")] == "kernel 128 bf16"
    assert got[("d=128", "bf16")] == "kernel 128 bf16"
    for key in [("d=256", "bf16"), ("d=300", "bf16")] + [(f"d={d}", "fp16") for d in (40, 64, 128)]:
        assert got[key].startswith("error flash-attn (nanoserve trimmed build): no kernels"), key
    assert "fp16" in got[("d=128", "fp16")] and "256" in got[("d=256", "bf16")]


def test_sha_mismatch_fails_loudly(tmp_path, sdist):
    bad = tmp_path / bfa.SDIST_NAME
    bad.write_bytes(b"not the sdist")
    with pytest.raises(bfa.BuildError, match="sha256 .* != pinned"):
        bfa.fetch_sdist(tmp_path)
    with pytest.raises(bfa.BuildError, match="sha256"):
        bfa.fetch_sdist(sdist.parent, sha256="0" * 64)


@pytest.mark.parametrize("args, message", [
    (["--head-dims", "100"], "unsupported head dim 100"),
    (["--head-dims", "abc"], "cannot parse"),
    (["--head-dims", ""], "no head dim chosen"),
    (["--dtypes", "fp32"], "unsupported dtype fp32"),
    (["--archs", "75"], "unsupported arch 75"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_arguments_are_rejected_before_any_work(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bfa.main(["--patch-only", "--out", str(tmp_path), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_archs_accept_sm_prefix_and_dedupe():
    assert bfa.parse_list("sm_90, 80,90") == ("80", "90")
    assert bfa.parse_list("128,64,128", int) == (64, 128)


def test_changed_sdist_layout_is_an_error_not_a_silent_full_build():
    with pytest.raises(bfa.BuildError, match="setup.py sources"):
        bfa.patch_setup("setup(name='flash_attn')\n", bfa.BuildSpec())


# ---- which backend auto picks -------------------------------------------------------

RECORD = {"VERSION": "2.8.3", "HEAD_DIMS": (128,), "DTYPES": ("bf16",), "ARCHS": ("90",)}


@pytest.mark.parametrize("head_dim, dtype, cap, problem", [
    (128, torch.bfloat16, (9, 0), None),
    (100, torch.bfloat16, (9, 0), None),                    # rounds up to the built 128
    (64, torch.bfloat16, (9, 0), "head dim 64 (kernel 64) not built"),
    (128, torch.float16, (9, 0), "dtype fp16 not built"),
    (128, torch.float32, (9, 0), "not fp16/bf16"),
    (128, torch.bfloat16, (8, 0), "GPU sm_80 not built"),
    (128, torch.bfloat16, (10, 0), "GPU sm_100 not built"),
    (512, torch.bfloat16, (9, 0), "head dim 512 > 256"),
])
def test_coverage_of_a_trimmed_build(head_dim, dtype, cap, problem):
    got = fab.coverage_problem(RECORD, head_dim, dtype, cap)
    assert got == problem if problem is None else problem in got


def test_coverage_sm80_build_runs_on_all_ampere():
    record = dict(RECORD, ARCHS=("80",))
    assert fab.coverage_problem(record, 128, torch.bfloat16, (8, 6)) is None
    assert fab.coverage_problem(record, 128, torch.bfloat16, (9, 0)) is not None
    # A build without our record (upstream, every kernel): only hard limits apply.
    assert fab.coverage_problem(None, 64, torch.float16, (9, 0)) is None
    assert "Ampere" in fab.coverage_problem(None, 64, torch.float16, (7, 5))


@pytest.fixture
def fake_gpu_with_flash(monkeypatch):
    """A CUDA device with compute capability 9.0 and an installed trimmed flash_attn."""
    monkeypatch.setattr(fab, "flash_attn_available", lambda: True)
    monkeypatch.setattr(fab, "build_record", lambda: RECORD)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    timed = []

    def fake_times(backends, shapes, device):
        timed.append((sorted(backends), shapes))
        return fake_times.result
    monkeypatch.setattr("kernels.backend_choice.time_backends", fake_times)
    fake_times.timed = timed
    return fake_times


QWEN3 = AttentionShapes(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("times, chosen", [({"flash_attn": 1e-4, "triton": 2e-4}, "flash_attn"),
                                           ({"flash_attn": 3e-4, "triton": 2e-4}, "triton")])
def test_auto_picks_the_faster_covered_backend_and_logs_why(fake_gpu_with_flash, caplog, times,
                                                            chosen):
    fake_gpu_with_flash.result = times
    with caplog.at_level(logging.INFO, logger="nanoserve.attention"):
        assert select_backend("auto", "cuda", shapes=QWEN3).name == chosen
    assert fake_gpu_with_flash.timed == [(["flash_attn", "triton"], QWEN3)]
    assert f"auto -> {chosen}" in caplog.text and "Hq=16 Hkv=8 D=128 bfloat16" in caplog.text
    assert all(f"{name} {t * 1e6:.0f} us" in caplog.text for name, t in times.items())


@pytest.mark.parametrize("shapes, reason", [
    (AttentionShapes(32, 8, 64, torch.bfloat16), "head dim 64 (kernel 64) not built"),
    (AttentionShapes(16, 8, 128, torch.float16), "dtype fp16 not built"),
    (AttentionShapes(16, 8, 128, torch.bfloat16, block_size=16), "block_size % 256 == 0"),
])
def test_auto_uses_triton_untimed_when_the_build_does_not_cover_the_model(
        fake_gpu_with_flash, caplog, shapes, reason):
    with caplog.at_level(logging.INFO, logger="nanoserve.attention"):
        assert select_backend("auto", "cuda", shapes=shapes).name == "triton"
    assert fake_gpu_with_flash.timed == []
    assert "auto -> triton: flash_attn" in caplog.text and reason in caplog.text
    with pytest.raises(ValueError, match="'flash_attn' unavailable: .*" + reason.split(" (")[0]):
        select_backend("flash_attn", "cuda", shapes=shapes)


def test_auto_takes_triton_untimed_where_prefill_graphs_will_be_captured(fake_gpu_with_flash,
                                                                        caplog):
    from worker_service.loading import prefill_graphs_wanted
    from worker_service.model_runner import RunnerConfig
    fake_gpu_with_flash.result = {"flash_attn": 1e-4, "triton": 2e-4}
    with caplog.at_level(logging.INFO, logger="nanoserve.attention"):
        assert select_backend("auto", "cuda", shapes=QWEN3, prefill_graphs=True).name == "triton"
    assert fake_gpu_with_flash.timed == [] and "prefill CUDA graphs need" in caplog.text
    assert select_backend("flash_attn", "cuda", shapes=QWEN3, prefill_graphs=True).name == "flash_attn"
    assert prefill_graphs_wanted(RunnerConfig(model_dir=""))
    assert not prefill_graphs_wanted(RunnerConfig(model_dir="", enforce_eager=True))
    assert not prefill_graphs_wanted(RunnerConfig(model_dir="", max_prefill_graph_tokens=0))


def test_auto_falls_back_to_triton_when_timing_fails(fake_gpu_with_flash, monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("flash-attn (nanoserve trimmed build): no kernels for bf16")
    monkeypatch.setattr("kernels.backend_choice.time_backends", broken)
    with caplog.at_level(logging.INFO, logger="nanoserve.attention"):
        assert select_backend("auto", "cuda", shapes=QWEN3).name == "triton"
    assert "timing the backends failed" in caplog.text


def test_time_backends_measures_real_forward_calls():
    """On CPU with the torch backend: a backend 100 ms slower per call must time slower."""
    class Slow(TorchBackend):
        def forward(self, *args):
            time.sleep(0.1)
            return super().forward(*args)

    shapes = AttentionShapes(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                             block_size=16)
    times = time_backends({"fast": TorchBackend(), "slow": Slow()}, shapes, torch.device("cpu"),
                          decode_seqs=[(40, 1), (17, 1)], prefill_seqs=[(20, 20), (33, 33)])
    # One decode + one prefill step, each call sleeping 100 ms: at least 200 ms in all.
    assert set(times) == {"fast", "slow"} and times["slow"] >= 0.2 > 0
    assert times["slow"] > times["fast"] > 0
