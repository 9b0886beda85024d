"""The model's own sampling defaults: what its generation_config.json recommends (Qwen3:
temperature 0.6, top_p 0.95, top_k 20; Llama 3: 0.6 and 0.9) for the fields a request leaves
out, as vLLM's `--generation-config auto` does. `--generation-config vllm` keeps the OpenAI
API's defaults (temperature 1, no top_p, top_k or min_p cut, no repetition penalty, max_tokens
up to the context) instead. Only the fields the file sets are taken; `do_sample` is not read (as
vLLM). The file's `max_new_tokens` is the default max_tokens; unlike vLLM, it does not cap a
request that names its own."""

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
    max_tokens: int | None = None  # tokens; None: up to the context (chat), 16 (completions)

    @classmethod
    def of_model(cls, folder: str | Path) -> SamplingDefaults:
        """The defaults folder/generation_config.json sets (the API's where it sets none, or
        has no such file). ValueError naming the file and the field when a value is out of the
        engine's bounds."""
        config = generation_config(folder)
        given = {f.name: config[f.name] for f in fields(cls) if config.get(f.name) is not None}
        given.pop("max_tokens", None)  # the file calls it max_new_tokens
        budget = config.get("max_new_tokens")
        if budget is not None:
            if type(budget) is not int or budget < 1:
                raise ValueError(
                    f"{Path(folder) / GENERATION_CONFIG_FILE}: max_new_tokens must be an "
                    f"integer >= 1, got {budget!r}"
                )
            given["max_tokens"] = budget
        if given.get("top_k") == 0:  # transformers' "no cut"
            given["top_k"] = -1
        defaults = replace(cls(), **given)
        defaults.check(str(Path(folder) / GENERATION_CONFIG_FILE))
        return defaults

    def check(self, source: str) -> None:
        from phasefleet.engine.sampling_params import SamplingParams

        try:
            SamplingParams(**{**asdict(self), "max_tokens": 1}).validate()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def max_tokens_or(self, api_default: int | None) -> int | None:
        """The default max_tokens: the smaller of the API's and the model's."""
        given = [v for v in (api_default, self.max_tokens) if v is not None]
        return min(given) if given else None

    def overridden(self) -> dict[str, Any]:
        """The fields that differ from the API's defaults (for the start-up log)."""
        api = SamplingDefaults()
        return {k: v for k, v in asdict(self).items() if getattr(api, k) != v}
