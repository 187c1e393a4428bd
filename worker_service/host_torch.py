"""Which torch a new virtualenv gets on this host (run by the Makefile, before .venv exists).

A venv of its own would hide the CUDA torch that GPU images (NGC, the PyTorch images) already
carry, and an unpinned `pip install torch` on a CPU host downloads gigabytes of CUDA
libraries it cannot use. So, in this order:

* system: the Python creating the venv already imports a CUDA build of torch -> the venv
  sees that Python's packages and keeps its torch (and triton); nothing is downloaded;
* cuda:   an NVIDIA GPU answers `nvidia-smi -L` -> PyPI's torch (its Linux wheels are CUDA
  builds), at the version constraints.txt pins;
* cpu:    otherwise -> the CPU build of that version: the one pip's own configuration finds
  (a mirror, find-links) if it is a CPU build (+cpu), else from PyTorch's CPU index
  (--cpu-index). Asking that index only when needed keeps set-up fast where it is
  unreachable (pip retries every package there, minutes in all).

Standard library only: it runs with the host's Python, before anything is installed.

    python3 worker_service/host_torch.py --venv .venv        # create .venv, install torch
    python3 worker_service/host_torch.py --print-choice      # only say which, and why
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The creating Python's torch: version, CUDA version, triton version, and where they live.
_PROBE = """
import json, os, site, torch
paths = [os.path.dirname(os.path.dirname(torch.__file__))]
try:
    import triton
    triton_version = triton.__version__
    paths.append(os.path.dirname(os.path.dirname(triton.__file__)))
except ImportError:
    triton_version = "none"
print(json.dumps([torch.__version__, torch.version.cuda or "none", triton_version,
                  paths + site.getsitepackages()]))
"""


def system_torch(python: str) -> tuple[str, str, str, list[str]] | None:
    """(torch version, CUDA version, triton version or "none", the folders holding them and
    the rest of `python`'s packages); None where it has no torch or a CPU-only build."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        torch_version, cuda, triton_version, paths = json.loads(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if out.returncode != 0 or cuda == "none":
        return None
    return torch_version, cuda, triton_version, list(dict.fromkeys(paths))


def has_nvidia_gpu() -> bool:
    """nvidia-smi on PATH lists at least one GPU (the driver is installed and sees one)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def choose(python: str) -> tuple[str, str, list[str], list[str]]:
    """("system" | "cuda" | "cpu", why, and where "system": the pins of the host's torch and
    the folders the venv must see)."""
    found = system_torch(python)
    if found:
        torch_version, cuda, triton_version, paths = found
        # Local labels (+cu128) are dropped: the public version matches the installed build.
        pins = [f"torch=={torch_version.split('+')[0]}"]
        pins += [f"triton=={triton_version}"] if triton_version != "none" else []
        return "system", f"{python} has torch {torch_version} built for CUDA {cuda}", pins, paths
    if has_nvidia_gpu():
        return ("cuda", "an NVIDIA GPU is present (nvidia-smi -L) and no CUDA torch is installed",
                [], [])
    return "cpu", "no NVIDIA GPU (nvidia-smi -L lists none)", [], []


def found_cpu_build(pip: list[str], requirement: str) -> bool:
    """pip, as configured, would install a CPU build (a +cpu local version) for requirement."""
    out = subprocess.run(pip + ["--dry-run", "--no-deps", "--report", "-", requirement],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return False
    try:
        chosen = [i["metadata"]["version"] for i in json.loads(out.stdout)["install"]]
    except (ValueError, KeyError):
        return False
    return any(v.endswith("+cpu") for v in chosen)


def pinned(constraints: Path, name: str) -> str:
    """`name==X` as constraints.txt pins it."""
    for line in constraints.read_text().splitlines():
        if line.split("#")[0].strip().startswith(f"{name}=="):
            return line.split("#")[0].strip()
    raise SystemExit(f"{constraints} pins no {name}")


def create(venv: Path, python: str, constraints: Path, cpu_index: str) -> str:
    """Create the venv with the chosen torch; write venv/constraints.txt, the pins every later
    install into it must keep (the repo's, or the system torch's own versions)."""
    mode, why, pins, paths = choose(python)
    print(f"host_torch: {mode} torch: {why}", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpython = str(venv / "bin" / "python")
    pip = [vpython, "-m", "pip", "install", "-q"]
    if mode == "system":
        # The host's packages go on the venv's path after its own: a .pth file, because
        # --system-site-packages would miss them where that Python is itself a venv (GPU
        # images that ship torch in one). Packages the project installs still win.
        site_dir = subprocess.run([vpython, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        Path(site_dir, "_host_packages.pth").write_text("\n".join(paths) + "\n")
    else:
        pins = [pinned(constraints, "torch"), pinned(constraints, "triton")]
        subprocess.run(install_command(mode, pip, pins[0], cpu_index), check=True)
    (venv / "constraints.txt").write_text("\n".join(pins) + "\n")
    return mode


def install_command(mode: str, pip: list[str], torch_pin: str, cpu_index: str) -> list[str]:
    """The pip command that installs torch in a new venv for mode "cuda" or "cpu"."""
    if mode == "cuda":   # PyPI's Linux wheels are the CUDA builds; their CUDA libraries come along
        return pip + [torch_pin]
    # The CPU build alone: its dependencies come with the project's, from the usual indexes.
    index = [] if not cpu_index or found_cpu_build(pip, torch_pin) else ["--index-url", cpu_index]
    return pip + ["--no-deps"] + index + [torch_pin]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, help="create this virtualenv and install torch in it")
    p.add_argument("--python", default=sys.executable, help="the Python that creates the venv")
    p.add_argument("--constraints", type=Path,
                   default=Path(__file__).resolve().parents[1] / "constraints.txt",
                   help="the torch and triton pins for a downloaded torch")
    p.add_argument("--cpu-index", default=os.environ.get("TORCH_CPU_INDEX", CPU_INDEX),
                   help="extra index with CPU builds of torch ('' = pip's configuration alone)")
    p.add_argument("--print-choice", action="store_true", help="print the choice and exit")
    args = p.parse_args(argv)
    if args.print_choice or args.venv is None:
        mode, why, _, _ = choose(args.python)
        print(f"{mode}: {why}")
        return 0
    create(args.venv, args.python, args.constraints, args.cpu_index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
