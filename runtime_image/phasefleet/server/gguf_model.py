"""GGUF models: a `.gguf` file (or a folder holding one) becomes a Hugging Face folder once.

transformers' own GGUF reader (the `gguf` package) dequantizes every tensor and maps the names
and llama.cpp's q/k row order back to a Hugging Face checkpoint; the result is saved as
safetensors in the engine's dtype and reused by every later start. Conversions are cached beside
the Hub cache (`$HF_HOME/phasefleet-gguf/<file stem>-<key>`), keyed by the file's path, size and
modification time, the dtype and the transformers version. A file we cannot serve (not GGUF, an
architecture or quantization type we cannot load) raises GGUFError before any conversion, with
one line naming it and what is supported.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from phasefleet.server.hub import ModelFetchError

logger = logging.getLogger("phasefleet.gguf")

SUFFIX = ".gguf"
# GGUF `general.architecture` values the engine runs (llama.cpp writes Mistral as "llama").
ARCHITECTURES = ("llama", "qwen2", "mistral")
DTYPES = ("float32", "bfloat16", "float16")
CACHE_SUBDIR = "phasefleet-gguf"


class GGUFError(ModelFetchError):
    """A GGUF file that cannot be served; str() is one line naming the cause and the fix."""


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: a `.gguf` file, or a folder without config.json that holds
    exactly one; None when `model` is neither (a Hugging Face folder, a repo id)."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GGUFError(f"folder {path} holds several GGUF files ({names}): name one with --model")
    return files[0] if files else None


def check_gguf(file: Path) -> None:
    """Raises GGUFError unless `file` is a GGUF model of a supported architecture whose every
    tensor type can be dequantized. Reads the header and tensor index only."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(file)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{file} is not a readable GGUF file ({_one_line(exc)})") from exc
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{file}: GGUF architecture {arch!r} is not supported; PhaseFleet serves"
            f" {', '.join(ARCHITECTURES)}"
        )
    bad = sorted({t.tensor_type.name for t in reader.tensors if not _dequantizable(t.tensor_type)})
    if bad:
        ok = sorted(t.name for t in GGMLQuantizationType if _dequantizable(t))
        raise GGUFError(
            f"{file}: GGUF quantization type {', '.join(bad)} cannot be loaded; supported:"
            f" {', '.join(ok)}"
        )


def _dequantizable(qtype: object) -> bool:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the types gguf's dequantize() implements

    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype in _type_traits


def cache_root() -> Path:
    """Beside the Hub cache: $HF_HOME/phasefleet-gguf (HF_HOME defaults as huggingface_hub's)."""
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home) / CACHE_SUBDIR


def gguf_folder(file: Path, dtype: str) -> Path:
    """The Hugging Face folder for `file` in `dtype`, converted now unless cached."""
    import transformers

    if dtype not in DTYPES:
        raise GGUFError(f"dtype for a GGUF conversion must be one of {DTYPES}, got {dtype!r}")
    stat = file.stat()
    identity = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    identity += f"|transformers {transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    dest = cache_root() / f"{file.stem}-{key}"
    convert(file, dest, dtype)
    return dest


def convert(file: Path, dest: Path, dtype: str) -> None:
    """Writes `file` as a Hugging Face folder at `dest` (config, tokenizer, safetensors), unless
    it is there. Concurrent callers wait on a lock and one converts; a partial conversion never
    appears at `dest` (it is written beside it, then renamed)."""
    if (dest / "config.json").is_file():
        return
    check_gguf(file)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.with_name(dest.name + ".lock")):
        if (dest / "config.json").is_file():
            return  # another process converted it while we waited
        tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_folder(file, tmp, dtype)
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_folder(file: Path, out: Path, dtype: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face folder in %s (once; cached)", file, dtype)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the GGUF tokenizer's "legacy" notice
    transformers.logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=getattr(torch, dtype)
        )
    except NotImplementedError as exc:  # a tensor type check_gguf let through
        raise GGUFError(f"{file}: {_one_line(exc)}") from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
