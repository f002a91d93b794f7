"""Prompts: text put in front of an input before tokenising, as sentence-transformers applies them.

A model's prompts come from its ``config_sentence_transformers.json`` (``ModelInfo.prompts``,
``default_prompt_name``); ``--default-prompt-name NAME=PROMPT_NAME`` and ``--default-prompt NAME=TEXT``
override the default per served model. A request picks one by name (TEI's and our ``prompt_name``) or
by Cohere's ``input_type``; without either, the default applies (none if the model has none). The
prompt's tokens count in ``usage`` and in the length limit; truncation cuts the text, never the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coalesce.kernels.protocol import ModelInfo

from ..errors import InvalidRequest
from ..settings import Settings

# Cohere's input types, and the prompt names that mean each (the first one the model has wins).
INPUT_TYPES: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "doc"),
    "classification": ("classification", "classify"),
    "clustering": ("clustering", "cluster"),
}


@dataclass(frozen=True, slots=True)
class Prompts:
    """One served model's prompts, with the server's overrides applied."""

    named: dict[str, str] = field(default_factory=dict)
    default: str | None = None  # the text applied when a request names no prompt

    @classmethod
    def of(cls, info: ModelInfo, settings: Settings) -> Prompts:
        """``info``'s prompts under ``settings``' overrides; a default name the model lacks is an error
        at start-up, not a surprise at the first request."""
        names = (info.name, *info.aliases)
        text = next((t for n, t in settings.default_prompts if n in names), None)
        if text is not None:
            return cls(dict(info.prompts), text)
        chosen = next((p for n, p in settings.default_prompt_names if n in names), info.default_prompt_name)
        if chosen is not None and chosen not in info.prompts:
            have = ", ".join(sorted(info.prompts)) or "none"
            raise ValueError(
                f"--default-prompt-name {info.name}={chosen}: model {info.name} has no prompt {chosen!r} "
                f"(it has: {have})"
            )
        return cls(dict(info.prompts), info.prompts[chosen] if chosen is not None else None)

    def pick(self, model: str, prompt_name: str | None, field: str = "prompt_name") -> str | None:
        """The prompt text for a request that names ``prompt_name`` (None: the default)."""
        if prompt_name is None:
            return self.default
        if not self.named:
            raise InvalidRequest(
                f"Model '{model}' has no prompts, so '{field}' cannot name one; put the prompt in front of "
                "the text instead.",
                param=field,
                code="unknown_prompt",
            )
        if prompt_name not in self.named:
            raise InvalidRequest(
                f"Model '{model}' has no prompt '{prompt_name}'; it has: {', '.join(sorted(self.named))}.",
                param=field,
                code="unknown_prompt",
            )
        return self.named[prompt_name]

    def for_input_type(self, model: str, input_type: str | None) -> str | None:
        """Cohere's ``input_type`` mapped to the model's prompts by name; a model without prompts takes
        any input type as it is (no prompt). None: the default."""
        if input_type is None:
            return self.default
        if input_type not in INPUT_TYPES:
            raise InvalidRequest(
                f"'input_type' must be one of {', '.join(INPUT_TYPES)}; got {input_type!r}.",
                param="input_type",
                code="invalid_value",
            )
        if not self.named:
            return None
        for name in INPUT_TYPES[input_type]:
            if name in self.named:
                return self.named[name]
        raise InvalidRequest(
            f"Model '{model}' has no prompt for input_type '{input_type}' (its prompts: "
            f"{', '.join(sorted(self.named))}).",
            param="input_type",
            code="unknown_prompt",
        )
