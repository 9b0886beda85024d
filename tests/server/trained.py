"""A tiny model trained, in seconds, to give one chat answer word for word: for tests of what
the worker does with a model's own text (a reasoning model's <think> block), which a random
model never writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_STEPS = 400
TARGET_LOSS = 1e-3  # mean cross-entropy per answer token: greedy then repeats it exactly


def train_to_answer(folder: Path, messages: list[dict[str, Any]], answer: str) -> Path:
    """Fits the make-tiny model in `folder`, in place, until its greedy answer to `messages`
    (chat template, generation prompt) is `answer` and then the end of the turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    target = tokenizer.encode(answer, add_special_tokens=False)
    target.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    ids = torch.tensor([list(prompt) + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # learn the answer only
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(MAX_STEPS):
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < TARGET_LOSS:
            break
    else:
        raise RuntimeError(f"the answer was not learned in {MAX_STEPS} steps: {loss.item():.4f}")
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder
