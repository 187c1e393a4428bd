"""Build a trimmed flash-attn 2 wheel from PyPI's sdist: only what nanoserve's worker calls.

PyPI has no flash-attn binary wheel, and its sdist compiles ~70 CUDA translation units for
four GPU archs (hours). The worker calls two functions, flash_attn_varlen_func (prefill) and
flash_attn_with_kvcache (decode, the split-KV kernel), causal, with no dropout, ALiBi,
softcap or sliding window, and never the backward pass. This script downloads the sdist
(sha256 pinned, cached in ~/.cache/nanoserve/flash-attn), patches it to compile only the
forward and split-KV forward kernels of the chosen head dims / dtypes / archs, and builds
a wheel. The wheel carries `flash_attn/_nanoserve_build.py` (what it was built for), which
kernels/flash_attn_backend.py reads so that `--attention-backend auto` picks flash_attn
only for models it covers. Calls it was not built for raise a RuntimeError, never run a
wrong kernel.

    python -m kernels.build_flash_attn                           # wheel into build/flash-attn/
    python -m kernels.build_flash_attn --head-dims 128 --dtypes bf16 --archs 90 --jobs 16
    python -m kernels.build_flash_attn --patch-only              # no nvcc: list what would compile
    python -m kernels.build_flash_attn --smoke                   # GPU: import + check vs torch
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "2.8.3"
SDIST_NAME = f"flash_attn-{VERSION}.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/3b/b2/"
             "8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0dab7/" + SDIST_NAME)
SDIST_SHA256 = "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d"
CACHE_DIR = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve")) / "flash-attn"

HEAD_DIMS = (32, 64, 96, 128, 192, 256)   # flash-attn 2's kernel buckets (a head dim rounds up)
DTYPES = ("bf16", "fp16")
ARCHS = ("80", "90")                      # Ampere, Hopper (the sm80 kernels run on both)
# Features the worker never uses: each one compiled out halves (or more) the instantiations.
# flash_api.cpp keeps a runtime check for each, so a call that wants one gets an error.
DISABLED = ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "LOCAL")
RECORD_MODULE = "_nanoserve_build.py"


class BuildError(RuntimeError):
    """The sdist is not what we pinned, or its layout no longer matches our patches."""


@dataclass(frozen=True)
class BuildSpec:
    head_dims: tuple[int, ...] = (128,)
    dtypes: tuple[str, ...] = DTYPES
    archs: tuple[str, ...] = ARCHS

    def __post_init__(self) -> None:
        for name, values, allowed in (("head dim", self.head_dims, HEAD_DIMS),
                                      ("dtype", self.dtypes, DTYPES), ("arch", self.archs, ARCHS)):
            if not values:
                raise ValueError(f"no {name} chosen (choose from {', '.join(map(str, allowed))})")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"unsupported {name} {', '.join(map(str, bad))}: flash-attn 2 "
                                 f"builds {', '.join(map(str, allowed))}")

    def kernel_sources(self) -> list[str]:
        """The .cu files to compile: forward and split-KV forward, causal and not."""
        return [f"csrc/flash_attn/src/flash_{kind}_hdim{d}_{t}{causal}_sm80.cu"
                for kind in ("fwd", "fwd_split") for d in self.head_dims for t in self.dtypes
                for causal in ("", "_causal")]

    def sources(self) -> list[str]:
        return ["csrc/flash_attn/flash_api.cpp"] + self.kernel_sources()

    def record(self) -> str:
        """Source of flash_attn/_nanoserve_build.py: what this wheel can run."""
        return (f'"""Written by nanoserve kernels/build_flash_attn.py: a trimmed flash-attn build.\n\n'
                f'Forward and split-KV forward only; compiled out: {", ".join(DISABLED).lower()}.\n"""\n'
                f"VERSION = {VERSION!r}\nHEAD_DIMS = {self.head_dims!r}\nDTYPES = {self.dtypes!r}\n"
                f"ARCHS = {self.archs!r}\nDISABLED = {DISABLED!r}\n")


def parse_list(text: str, kind=str) -> tuple:
    """'128, 64' -> (64, 128): sorted, deduplicated."""
    items = [t.strip().removeprefix("sm_").removeprefix("sm") for t in text.split(",") if t.strip()]
    try:
        return tuple(sorted({kind(t) for t in items}))
    except ValueError:
        raise ValueError(f"cannot parse {text!r} as a comma-separated list of {kind.__name__}") from None


# ---- sdist --------------------------------------------------------------------------

def fetch_sdist(cache_dir: Path = CACHE_DIR, url: str = SDIST_URL,
                sha256: str = SDIST_SHA256) -> Path:
    """The pinned sdist, downloaded once into cache_dir; a wrong hash is an error, never used."""
    path = cache_dir / SDIST_NAME
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        print(f"downloading {url}", file=sys.stderr)
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        tmp.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise BuildError(f"{path}: sha256 {digest} != pinned {sha256} (corrupt or tampered "
                         f"download; delete it to fetch again)")
    return path


def unpack(sdist: Path, work_dir: Path) -> Path:
    """Extract a fresh copy of the sdist into work_dir; returns the source root."""
    root = work_dir / f"flash_attn-{VERSION}"
    if root.exists():
        shutil.rmtree(root)
    work_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        # The "data" filter refuses links/paths leaving work_dir (Python >= 3.11.4 / 3.12).
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work_dir, **kw)
    if not (root / "setup.py").exists():
        raise BuildError(f"{sdist} has no flash_attn-{VERSION}/setup.py")
    return root


# ---- patches ------------------------------------------------------------------------

def _replace_once(text: str, pattern: str, new: str, what: str, flags: int = 0) -> str:
    out, n = re.subn(pattern, lambda _: new, text, flags=flags)
    if n != 1:
        raise BuildError(f"patch '{what}': expected 1 match, found {n} (sdist layout changed?)")
    return out


def _macro(name: str, params: str, body: list[str]) -> str:
    """A multi-line #define with aligned continuation backslashes."""
    lines = [f"#define {name}({params})"] + body
    width = max(map(len, lines)) + 1
    return "\n".join(l.ljust(width) + "\\" for l in lines[:-1]) + "\n" + lines[-1] + "\n"


def switch_macros(spec: BuildSpec) -> str:
    """FP16_SWITCH / HEADDIM_SWITCH instantiating only the built kernels; the rest throw."""
    fp16 = ["using elem_type = cutlass::half_t;", "return __VA_ARGS__();"]
    bf16 = ["using elem_type = cutlass::bfloat16_t;", "return __VA_ARGS__();"]
    missing = lambda what: [f'throw std::runtime_error("flash-attn (nanoserve trimmed build): "'   # noqa: E731
                            f' "no kernels for {what}; rebuild with kernels/build_flash_attn.py");']
    fp16_body = fp16 if "fp16" in spec.dtypes else missing("fp16")
    bf16_body = bf16 if "bf16" in spec.dtypes else missing("bf16")
    dtype = (["  [&] {", "    if (COND) {"] + ["      " + l for l in fp16_body] + ["    } else {"]
             + ["      " + l for l in bf16_body] + ["    }", "  }()"])
    head = ["  [&] {"]
    for i, d in enumerate(HEAD_DIMS):
        head.append(f"    {'if' if i == 0 else '} else if'} (HEADDIM <= {d}) {{")
        body = ([f"constexpr static int kHeadDim = {d};", "return __VA_ARGS__();"]
                if d in spec.head_dims else missing(f"head dim {d}"))
        head += ["      " + l for l in body]
    head += ["    } else {"] + ["      " + l for l in missing("head dim > 256")] + ["    }", "  }()"]
    return _macro("FP16_SWITCH", "COND, ...", dtype) + "\n" + _macro("HEADDIM_SWITCH", "HEADDIM, ...", head)


def patch_static_switch(text: str, spec: BuildSpec) -> str:
    text = _replace_once(text, r"#define FP16_SWITCH\(.*?\}\(\)\n\n#define HEADDIM_SWITCH\(.*?\}\(\)\n",
                         switch_macros(spec), "static_switch.h FP16/HEADDIM_SWITCH", re.S)
    return text.replace("#pragma once\n", "#pragma once\n\n#include <stdexcept>\n", 1)


def patch_flash_api(text: str) -> str:
    """run_mha_bwd would need the backward kernels we don't compile: make it an error."""
    return _replace_once(
        text, r"void run_mha_bwd\(Flash_bwd_params &params, cudaStream_t stream\) \{\n.*?\n\}\n",
        "void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {\n"
        '    TORCH_CHECK(false, "This flash attention build does not support backward.");\n}\n',
        "flash_api.cpp run_mha_bwd", re.S)


def patch_setup(text: str, spec: BuildSpec) -> str:
    sources = "".join(f'\n                "{s}",' for s in spec.sources())
    text = _replace_once(text, r'sources=\[\s*"csrc/flash_attn/flash_api\.cpp",.*?\],',
                         f"sources=[{sources}\n            ],", "setup.py sources", re.S)
    defines = ", ".join(f'"-DFLASHATTENTION_DISABLE_{f}"' for f in DISABLED)
    text = _replace_once(text, r'"cxx": compiler_c17_flag,', f'"cxx": compiler_c17_flag + [{defines}],',
                         "setup.py cxx flags")
    return _replace_once(text, r'"nvcc": append_nvcc_threads\(nvcc_flags \+ cc_flag\),',
                         f'"nvcc": append_nvcc_threads(nvcc_flags + cc_flag + [{defines}]),',
                         "setup.py nvcc flags")


def patch_tree(root: Path, spec: BuildSpec) -> list[str]:
    """Apply every patch to an unpacked sdist; returns the sources setup.py will compile."""
    for rel, fn in (("setup.py", lambda t: patch_setup(t, spec)),
                    ("csrc/flash_attn/src/static_switch.h", lambda t: patch_static_switch(t, spec)),
                    ("csrc/flash_attn/flash_api.cpp", patch_flash_api)):
        path = root / rel
        path.write_text(fn(path.read_text()))
    missing = [s for s in spec.sources() if not (root / s).exists()]
    if missing:
        raise BuildError(f"sources missing from the sdist: {missing}")
    (root / "flash_attn" / RECORD_MODULE).write_text(spec.record())
    return compiled_sources(root)


def compiled_sources(root: Path) -> list[str]:
    """The source list that (patched) setup.py hands to CUDAExtension, read back from it."""
    block = re.search(r'name="flash_attn_2_cuda",\s*sources=\[(.*?)\]', (root / "setup.py").read_text(), re.S)
    if block is None:
        raise BuildError("setup.py: no flash_attn_2_cuda sources list")
    return re.findall(r'"([^"]+)"', block.group(1))


# ---- build / smoke ------------------------------------------------------------------

def build_wheel(root: Path, spec: BuildSpec, out_dir: Path, jobs: int) -> Path:
    """pip wheel against the installed torch (no build isolation); returns the wheel path."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise BuildError("nvcc not found (install a CUDA toolkit or set CUDA_HOME)")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLASH_ATTENTION_FORCE_BUILD="TRUE", FLASH_ATTN_CUDA_ARCHS=";".join(spec.archs),
               MAX_JOBS=str(jobs), NVCC_THREADS=str(len(spec.archs)),
               FLASH_ATTN_LOCAL_VERSION="nanoserve")
    before = set(out_dir.glob("flash_attn-*.whl"))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                    "--no-index", "-w", str(out_dir), str(root)], env=env, check=True)
    wheels = sorted(set(out_dir.glob("flash_attn-*.whl")) - before) or sorted(out_dir.glob("flash_attn-*.whl"))
    print(f"built {wheels[-1]} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return wheels[-1]


def smoke() -> None:
    """Import the installed flash_attn and check one paged varlen + one kvcache call vs torch."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script too
    from kernels.attention import AttentionMetadata, paged_attention_ref
    from kernels.flash_attn_backend import build_record, flash_decode, flash_prefill
    print(f"flash_attn build record: {build_record()}")
    torch.manual_seed(0)
    bs, hkv, hq, d, dt = 256, 8, 16, 128, torch.bfloat16
    ctx, q_lens = [700, 300, 1], [200, 300, 1]
    tables = torch.randperm(16, dtype=torch.int32, device="cuda")[:12].view(3, 4).contiguous()
    i32 = dict(dtype=torch.int32, device="cuda")
    k_cache = torch.randn(16, bs, hkv, d, device="cuda", dtype=dt)
    v_cache = torch.randn_like(k_cache)
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), **i32)   # noqa: E731
    meta = AttentionMetadata(slot_mapping=torch.empty(0, **i32), block_tables=tables,
                             context_lens=torch.tensor(ctx, **i32), cu_seqlens_q=cu(q_lens),
                             cu_seqlens_k=cu(ctx), max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx),
                             is_decode=False)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dt)
    out = flash_prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                        meta.max_seqlen_q, meta.max_seqlen_k, tables, d ** -0.5)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, d ** -0.5)
    rel_p = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    qd = torch.randn(3, hq, d, device="cuda", dtype=dt)
    dmeta = AttentionMetadata(meta.slot_mapping, tables, meta.context_lens, cu([1, 1, 1]),
                              meta.cu_seqlens_k, 1, max(ctx), is_decode=True)
    out = flash_decode(qd, k_cache, v_cache, dmeta.context_lens, tables, d ** -0.5)
    ref = paged_attention_ref(qd, k_cache, v_cache, dmeta, d ** -0.5)
    rel_d = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"smoke: varlen prefill rel err {rel_p:.2e}, kvcache decode rel err {rel_d:.2e}")
    if not (rel_p < 1e-2 and rel_d < 1e-2):
        raise SystemExit("smoke FAILED: flash-attn disagrees with the torch reference")
    print("smoke OK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="128",
                   help="comma list of kernel head dims to compile (32,64,96,128,192,256; a "
                        "model's head dim uses the smallest bucket >= it). Qwen3: 128")
    p.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
    p.add_argument("--archs", default="80,90",
                   help="comma list of GPU archs: 80 (A100/Ampere), 90 (H100/H200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel nvcc jobs (MAX_JOBS); each can take several GB of RAM")
    p.add_argument("--out", type=Path, default=Path("build/flash-attn"),
                   help="work dir: unpacked sources in it, the wheel in OUT/dist")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where the sdist is kept")
    p.add_argument("--patch-only", action="store_true",
                   help="patch the sources and list what would compile; no nvcc needed")
    p.add_argument("--install", action="store_true", help="pip install the wheel once built")
    p.add_argument("--smoke", action="store_true",
                   help="only check the installed flash_attn on a GPU against torch (no build)")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    try:
        spec = BuildSpec(parse_list(args.head_dims, int), parse_list(args.dtypes), parse_list(args.archs))
    except ValueError as e:
        p.error(str(e))
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    root = unpack(fetch_sdist(args.cache_dir), args.out)
    sources = patch_tree(root, spec)
    print(f"flash-attn {VERSION}: {len(sources)} sources, archs {','.join(spec.archs)}")
    for s in sources:
        print(f"  {s}")
    if args.patch_only:
        return
    wheel = build_wheel(root, spec, args.out / "dist", args.jobs)
    print(wheel)
    if args.install:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall",
                        str(wheel)], check=True)


if __name__ == "__main__":
    main()
