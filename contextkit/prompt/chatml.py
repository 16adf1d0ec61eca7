"""ChatML prompt pieces the pipeline assembles token ranges from."""

from __future__ import annotations

from typing import Any

__all__ = ["ChatML"]


class ChatML:
    """ChatML pieces (``<|im_start|>role\\n ... <|im_end|>\\n``), as SmolLM2 uses."""

    START, END = "<|im_start|>", "<|im_end|>"

    @classmethod
    def check(cls, tokenizer: Any) -> None:
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # no template at all
            raise ValueError(f"the tokenizer has no usable chat template ({exc})") from exc
        want = (f"{cls.START}system\nS{cls.END}\n{cls.START}user\nU{cls.END}\n"
                f"{cls.START}assistant\n")
        if text != want:
            raise ValueError("contextkit's pipeline assembles ChatML prompts; this tokenizer's "
                             f"chat template renders {text!r}. Use a ChatML model (SmolLM2, "
                             "Qwen) or pass prompts to Engine.generate yourself")

    @classmethod
    def open(cls, role: str) -> str:
        return f"{cls.START}{role}\n"

    @classmethod
    def close(cls) -> str:
        return f"{cls.END}\n"
