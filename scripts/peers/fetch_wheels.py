"""Download the wheels a peer engine (vLLM or SGLang) needs on the GPU machine, and pack them for transfer.

    python scripts/peers/fetch_wheels.py vllm|sglang [--resolve] [--piece-mb 30]

The GPU machine has torch 2.11 (CUDA 13), transformers and many other packages (image_packages.txt),
and no network. This resolves the peer's dependency closure for that machine (CPython 3.12, manylinux
x86-64) with torch, torchvision, torchaudio and triton taken as given, keeps what the image lacks (plus
the packages the peer pins to another version than the image's: CARRY), leaves out heavy packages
that the benchmarked path (a Qwen2 target with a DFlash drafter on Hopper) never imports (SKIP), and
writes the list to scripts/peers/<peer>.lock. Without --resolve the lock is used as is.

The wheels land in .whl/<peer>/ (git-ignored) and are packed into one tar split into pieces of
--piece-mb MiB under .gpu/xfer/<peer>-wheels.tar/NNN/, one device call each (the GGUF's way,
../shared/gpu/README.md); `bash scripts/peers/install.sh <peer>` on the device installs them into
/tmp/peers/<peer>, the directory `scripts/bench_peers.py --peer-site` takes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[arg for tag in ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
                              "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
                              "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_5_x86_64",
                              "manylinux1_x86_64", "any") for arg in ("--platform", tag)]]
GIVEN = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0"}  # the image's
PEERS = {"vllm": "vllm==0.26.0", "sglang": "sglang==0.5.17"}
# kernels for other models or chips (MLA, Blackwell CuTe DSL, TileLang), video decoding and the CUDA compiler
# wheels those pull in: not imported when serving a Qwen2 target with a DFlash drafter on an H100/H200
SKIP = {"tokenspeed-triton", "tokenspeed-mla", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13",
        "nvidia-nvvm", "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-nvdisasm",
        "tilelang", "z3-solver", "pynvvideocodec", "torchcodec", "cuda-tile", "nvidia-mathdx", "helion",
        "flash-attn-4", "sgl-deep-gemm", "py-spy", "modelscope"}
CARRY = {"sglang": {"transformers"}}  # pinned by the peer to a version the image does not have
# transformers 5.12.1 (SGLang's pin) refuses the image's tokenizers 0.23.2 at import (it wants <= 0.23.0)
EXTRA = {"sglang": ["tokenizers==0.22.2"]}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (HERE / "image_packages.txt").read_text(encoding="utf-8").splitlines()
    return {normalize(n) for line in lines if not line.startswith("#") for n in line.split()}


def stub_wheels(directory: Path) -> list[str]:
    """Empty wheels standing for the image's torch & co., so the resolver neither downloads nor replaces them
    (a local version label makes them win over the index's builds of the same version)."""
    requirements = []
    for name, version in GIVEN.items():
        version = f"{version}+image"
        info = f"{name}-{version}.dist-info"
        with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            whl.writestr(f"{info}/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{info}/RECORD", "")
        requirements.append(f"{name}=={version}")
    return requirements


def resolve(peer: str) -> list[str]:
    """name==version of every wheel to carry, from pip's resolver run for the GPU machine."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs = stub_wheels(Path(tmp))
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                        str(report), *PLATFORM, "--find-links", tmp, "--target", str(Path(tmp) / "t"), PEERS[peer],
                        *stubs], check=True)
        installs = json.loads(report.read_text(encoding="utf-8"))["install"]
    image, carry = image_packages(), CARRY.get(peer, set())
    keep = []
    for item in installs:
        name, version = normalize(item["metadata"]["name"]), item["metadata"]["version"]
        if name in GIVEN or name in SKIP or (name in image and name not in carry):
            continue
        keep.append(f"{name}=={version}")
    return sorted(keep + EXTRA.get(peer, []))


def download(requirements: list[str], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(directory),
                    *requirements], check=True)
    wanted = {normalize(r.split("==")[0]) for r in requirements}
    return sorted(p for p in directory.glob("*.whl") if normalize(p.name.split("-")[0]) in wanted)


def pack(peer: str, wheels: list[Path], piece_mb: int) -> Path:
    """One uncompressed tar of the wheels (they are compressed already), split into numbered piece folders."""
    out = ROOT / ".gpu" / "xfer" / f"{peer}-wheels.tar"
    if out.exists():
        for old in sorted(out.rglob("*"), reverse=True):
            old.unlink() if old.is_file() else old.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "all.tar"
    with tarfile.open(archive, "w") as tar:
        for wheel in wheels:
            tar.add(wheel, arcname=wheel.name)
    data, size, index = archive.open("rb"), piece_mb << 20, 0
    while chunk := data.read(size):
        piece = out / f"{index:03d}"
        piece.mkdir()
        (piece / f"{peer}-wheels.tar.part.{index:03d}").write_bytes(chunk)
        index += 1
    data.close()
    archive.unlink()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer", choices=sorted(PEERS))
    p.add_argument("--resolve", action="store_true", help="resolve again and rewrite scripts/peers/<peer>.lock")
    p.add_argument("--piece-mb", type=int, default=30,
                   help="piece size: a piece, the repo's tracked files (~25 MiB) and nothing else fit one call's 64 MiB")
    args = p.parse_args(argv)
    lock = HERE / f"{args.peer}.lock"
    if args.resolve or not lock.exists():
        lock.write_text("\n".join(resolve(args.peer)) + "\n", encoding="utf-8")
    requirements = lock.read_text(encoding="utf-8").split()
    wheels = download(requirements, ROOT / ".whl" / args.peer)
    out = pack(args.peer, wheels, args.piece_mb)
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {total:.0f} MiB -> {len(list(out.iterdir()))} pieces in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
