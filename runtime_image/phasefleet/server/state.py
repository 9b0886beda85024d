"""WorkerState: what every handler of one worker shares, and the checks they all make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasefleet.server.async_engine import AsyncEngine
from phasefleet.server.errors import APIError, bad_request, unavailable
from phasefleet.server.metrics import WorkerMetrics

ROLES = ("both", "prefill", "decode")


@dataclass
class WorkerState:
    engine: AsyncEngine
    tokenizer: Any  # a Hugging Face tokenizer; used on the event loop thread only
    vocab_size: int  # rows of the model's embedding: token ids must be below it
    served_model_name: str
    model_path: str
    role: str  # both | prefill | decode
    metrics: WorkerMetrics
    draining: bool = False

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this worker serves "
                f"'{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the worker is draining and takes no new requests", "draining")
        if self.engine.fatal_error is not None:
            raise unavailable("the engine failed and the worker is exiting", "engine_failed")
        if not self.engine.ready:
            raise unavailable("the model is still loading", "not_ready")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_token_ids(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise bad_request(f"{field} must not be empty", field)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise bad_request(
                f"{field} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                field,
            )
        return ids
