"""What a lent GPU machine needs for bench/gpu_check.py and lacks, packed here into .gpu-pack/
(gitignored) for the two calls docs/engine.md ("The GPU check") gives. That machine has no
network and Python 3.12 with torch, triton and accelerate, but no pydantic, fastapi, uvicorn,
gguf or openai, and transformers 5, tokenizers 0.23 and huggingface_hub 1, which our
transformers pin (4.57.6) cannot use.

    .venv/bin/python bench/gpu_pack.py     # make gpu-pack; here, with the network
    python3 bench/gpu_pack.py verify DIR   # there, by bench/gpu_box.sh: the wheels installed
    python3 bench/gpu_pack.py join         #   in DIR against what the machine has; SmolLM2

.gpu-pack/wheels/     WHEELS for CPython 3.12 manylinux x86_64, each at the version the .venv
                      runs (pyproject.toml pins the direct ones), one version each
.gpu-pack/smollm2-a/  the first part of SmolLM2's .gguf: call 1 carries it, the machine keeps it
.gpu-pack/smollm2-b/  the rest and the whole file's sha256: call 2 carries it with wheels/

The .gguf (94 MiB) fits no single call (64 MiB with the repository), so it is cut where both
calls keep the same room to spare. Prints what each call sends; exits 1 when one is over 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACK = REPO / ".gpu-pack"
WHEELS, PART_A, PART_B = PACK / "wheels", PACK / "smollm2-a", PACK / "smollm2-b"
STAGE = REPO / ".gpu-stage"  # on the GPU machine: call 1 leaves part a here for call 2
MODELS = REPO / ".gpu-models"  # on the GPU machine: the joined .gguf, gpu_check's default place
LIMIT = 64 * 2**20  # bytes one call may send: the working tree and what it carries
MIB = 2**20

# The closure of what phasefleet.engine, .server, .local, .router, the CLI, tests/engine and
# tests/models import, less what the GPU machine has in a version that satisfies it
# (/work/.library/device/KINDS.md lists its packages).
WHEELS_MISSING = [
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",  # the API models
    "fastapi", "starlette", "opentelemetry-api",  # the worker's and the router's app
    "uvicorn",
    "gguf",  # transformers' GGUF reader (SmolLM2's .gguf)
    "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio",  # tests/models' client
    "llguidance",  # structured output (engine/grammar.py, tests/engine/test_grammar.py)
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",  # tests/models
]  # fmt: skip
# there: 5.x, 1.x, 0.23; and a peft (tests/engine/test_lora.py's reference) made for those
WHEELS_TOO_NEW = ["transformers", "huggingface-hub", "tokenizers", "peft"]
WHEEL_NAMES = WHEELS_MISSING + WHEELS_TOO_NEW
PLATFORMS = [  # the GPU machine: Ubuntu 24.04's Python 3.12.3, glibc 2.39
    "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
]  # fmt: skip


def tree_bytes() -> int:
    """Bytes of what every call sends besides its carry: tracked files and untracked ones git
    does not ignore (and shared/, where the checkout has one)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = {REPO / os.fsdecode(p) for p in listed.split(b"\0") if p}
    total = sum(p.lstat().st_size for p in paths if os.path.lexists(p))
    shared = REPO / "shared"
    return total + (folder_bytes(shared) if shared.is_dir() else 0)


def folder_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if not p.is_dir())


def download_wheels() -> None:
    """One wheel per name of WHEEL_NAMES, at the version this interpreter has installed."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for name in WHEEL_NAMES:
        try:
            wanted[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"gpu_pack: {name} is not installed in {sys.executable}: run make venv")
    keep = {wheel_key(name, version) for name, version in wanted.items()}
    for stale in WHEELS.glob("*.whl"):
        if wheel_key(*stale.name.split("-")[:2]) not in keep:
            stale.unlink()  # another version, or a name no longer packed
    missing = [f"{n}=={v}" for n, v in wanted.items() if not list(WHEELS.glob(wheel_glob(n, v)))]
    if missing:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        command += [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([*command, "-d", str(WHEELS), *missing], check=True)
    for name, version in wanted.items():
        found = list(WHEELS.glob(wheel_glob(name, version)))
        if len(found) != 1:
            sys.exit(f"gpu_pack: expected one wheel of {name}=={version}, found {found}")


def wheel_key(name: str, version: str) -> tuple[str, str]:
    return name.lower().replace("-", "_").replace(".", "_"), version


def wheel_glob(name: str, version: str) -> str:
    return f"{wheel_key(name, version)[0]}-{version}-*.whl"


def split_model(gguf: Path, tree: int, wheels: int) -> None:
    """Cuts the .gguf so both calls keep the same room under LIMIT; writes its sha256 beside
    part b."""
    size = gguf.stat().st_size
    room = (2 * LIMIT - 2 * tree - wheels - size) // 2
    first = min(LIMIT - tree - room, size)  # call 1: the tree and part a
    for folder in (PART_A, PART_B):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    digest = hashlib.sha256()
    with gguf.open("rb") as src:
        for part, length in ((PART_A, first), (PART_B, size - first)):
            with (part / f"{gguf.name}.part").open("wb") as dst:
                left = max(length, 0)
                while left > 0 and (chunk := src.read(min(left, 8 * MIB))):
                    digest.update(chunk)
                    dst.write(chunk)
                    left -= len(chunk)
    (PART_B / f"{gguf.name}.sha256").write_text(f"{digest.hexdigest()}  {gguf.name}\n")


def pack(args: argparse.Namespace) -> int:
    download_wheels()
    tree, wheels = tree_bytes(), folder_bytes(WHEELS)
    calls = {"call 2 (the check)": [WHEELS]}
    if args.no_model:
        shutil.rmtree(PART_A, ignore_errors=True)
        shutil.rmtree(PART_B, ignore_errors=True)
    else:
        from phasefleet.server.named_models import SMOLLM2, models_dir

        gguf = args.gguf or models_dir() / f"{SMOLLM2.folder_name}.gguf"
        if not gguf.is_file():
            sys.exit(f"gpu_pack: no {gguf}: `make run` fetches SmolLM2 (or pass --no-model)")
        split_model(gguf, tree, wheels)
        calls = {"call 1 (stage)": [PART_A], "call 2 (the check)": [WHEELS, PART_B]}
    over = False
    print(f"the working tree: {tree / MIB:.1f} MiB (tracked + untracked-not-ignored)")
    for call, carried in calls.items():
        total = tree + sum(folder_bytes(c) for c in carried)
        each = ", ".join(f"{c.relative_to(REPO)} {folder_bytes(c) / MIB:.1f} MiB" for c in carried)
        print(f"{call}: carries {each}; sends {total / MIB:.1f} of {LIMIT / MIB:.0f} MiB")
        over = over or total > LIMIT
    if over:
        print("gpu_pack: over the limit: the tree grew (untracked files?); see docs/engine.md")
    return 1 if over else 0


def join(_: argparse.Namespace) -> int:
    """On the GPU machine: SmolLM2's .gguf from the staged part a and the carried part b into
    .gpu-models/, checked against its sha256. 0 when it is there, 1 when it cannot be."""
    sums = list(PART_B.glob("*.sha256"))
    if not sums:
        print("gpu_pack join: no .gpu-pack/smollm2-b carried: the SmolLM2 checks will not run")
        return 1
    expected, name = sums[0].read_text().split()
    target = MODELS / name
    if target.is_file() and sha256(target) == expected:
        print(f"gpu_pack join: {target.relative_to(REPO)} is already here")
        return 0
    first, rest = STAGE / f"{name}.part", PART_B / f"{name}.part"
    if not first.is_file():
        print(
            "gpu_pack join: part a is not on this machine: it is a fresh one (call 1 ran on "
            "another, or not at all; call 2 must follow within the 30 s the machine stays "
            "warm): the SmolLM2 checks will not run"
        )
        return 1
    MODELS.mkdir(exist_ok=True)
    part = target.with_name(name + ".joining")
    with part.open("wb") as dst:
        for piece in (first, rest):
            with piece.open("rb") as src:
                shutil.copyfileobj(src, dst, 8 * MIB)
    if sha256(part) != expected:
        part.unlink()
        print(f"gpu_pack join: {name} joined with the wrong sha256 (a stale part a?)")
        return 1
    os.replace(part, target)
    print(f"gpu_pack join: {target.relative_to(REPO)} joined, sha256 checked")
    return 0


def verify(args: argparse.Namespace) -> int:
    """On the GPU machine, with DIR first on sys.path: prints the versions the check will run
    with, and each requirement of a wheel installed in DIR that what is importable here does
    not meet (a lead when a check then fails on an import). Always 0."""
    from packaging.requirements import Requirement

    def have(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    shown = ["torch", "triton", "numpy", "safetensors", "accelerate", *WHEELS_TOO_NEW, "httpx"]
    print("gpu_pack verify:", ", ".join(f"{n} {have(n)}" for n in shown))
    unmet = []
    for dist in importlib.metadata.distributions(path=[str(args.site)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            version = have(req.name)
            if version is None or not req.specifier.contains(version, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {req}, here {version or 'none'}")
    print("gpu_pack verify:", "; ".join(unmet) if unmet else "every requirement met")
    return 0


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("action", nargs="?", choices=("pack", "verify", "join"), default="pack")
    p.add_argument("site", nargs="?", type=Path, help="verify: where the wheels were installed")
    p.add_argument("--no-model", action="store_true", help="wheels only: one call, no SmolLM2")
    p.add_argument("--gguf", type=Path, help="SmolLM2's .gguf (default: the PHASEFLEET_CACHE one)")
    args = p.parse_args()
    return {"pack": pack, "verify": verify, "join": join}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
