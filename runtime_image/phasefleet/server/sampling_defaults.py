"""The model's own sampling defaults: what its generation_config.json recommends (Qwen3:
temperature 0.6, top_p 0.95, top_k 20; Llama 3: 0.6 and 0.9) for the fields a request leaves
out, as vLLM's `--generation-config auto` does. `--generation-config vllm` keeps the OpenAI
API's defaults (temperature 1, no top_p, top_k or min_p cut, no repetition penalty) instead.
Only the fields the file sets are taken; `do_sample` is not read (as vLLM)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from phasefleet.engine.tokenizer import GENERATION_CONFIG_FILE, generation_config

GENERATION_CONFIGS = ("auto", "vllm")  # --generation-config: the model's defaults, or the API's


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of_model(cls, folder: str | Path) -> SamplingDefaults:
        """The defaults folder/generation_config.json sets (the API's where it sets none, or
        has no such file). ValueError naming the file and the field when a value is out of the
        engine's bounds."""
        config = generation_config(folder)
        given = {f.name: config[f.name] for f in fields(cls) if config.get(f.name) is not None}
        if given.get("top_k") == 0:  # transformers' "no cut"
            given["top_k"] = -1
        defaults = replace(cls(), **given)
        defaults.check(str(Path(folder) / GENERATION_CONFIG_FILE))
        return defaults

    def check(self, source: str) -> None:
        from phasefleet.engine.sampling_params import SamplingParams

        try:
            SamplingParams(max_tokens=1, **asdict(self)).validate()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def overridden(self) -> dict[str, Any]:
        """The fields that differ from the API's defaults (for the start-up log)."""
        api = SamplingDefaults()
        return {k: v for k, v in asdict(self).items() if getattr(api, k) != v}
