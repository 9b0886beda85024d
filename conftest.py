"""Loaded by pytest before any test module.

The openai client builds its response models' pydantic schemas lazily, on first use, and two
threads that first parse the same type at once can race (PydanticUserError "BaseModel cannot be
instantiated directly" from one of them). Tests that stream from several threads hit it on a
busy machine, so every model is built when its module is imported (under the import lock)."""

import os

os.environ.setdefault("DEFER_PYDANTIC_BUILD", "false")
