"""Loading a model's tokenizer from its local directory and rendering chat prompts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jinja2
from transformers import AutoTokenizer

_TOKENIZER_MODES = ("auto", "slow")


def get_tokenizer(model_dir: str | Path, tokenizer_mode: str = "auto") -> Any:
    """Load the tokenizer stored in ``model_dir``; never touches the network and never runs the checkpoint's code.

    ``tokenizer_mode="slow"`` asks for the Python tokenizer instead of the Rust one where the
    model has both. A tokenizer that only its own Python files (``auto_map`` in tokenizer_config.json or
    config.json) can build is refused with ValueError: ``trust_remote_code`` is always off, and there is no way to
    turn it on, because a checkpoint (a Hub repo, an S3 prefix) is not code anyone reviewed.
    """
    if tokenizer_mode not in _TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be one of {', '.join(_TOKENIZER_MODES)}, got {tokenizer_mode!r}.")
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (tokenizers are only loaded from local files).")
    try:
        return AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, use_fast=tokenizer_mode == "auto"
        )
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"the tokenizer in {str(path)!r} needs the checkpoint's own Python code (auto_map), which pagoda never "
            "runs; use a checkpoint whose tokenizer is a standard transformers class"
        ) from None


def check_text(text: str, what: str) -> None:
    """ValueError if ``text`` is not valid Unicode: a lone surrogate (JSON's ``"\\ud800"``) makes the
    tokenizers raise TypeError and cannot be encoded to UTF-8 for a response either."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
        ) from None


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize a prompt; ValueError (naming no internals) for text the tokenizer cannot take."""
    check_text(text, "the prompt")
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # refused input; BaseException too: a Rust panic (PanicException) is one
        raise ValueError(f"the prompt could not be tokenized ({type(exc).__name__})") from exc


@dataclass(frozen=True, slots=True)
class ChatRenderOptions:
    """What a chat hands its template besides the messages (picklable: the server's tokenizer pool sends it).

    ``continue_final_message`` leaves the last (assistant) message open for the model to continue;
    ``template_kwargs`` are extra template variables (e.g. Qwen3's ``enable_thinking``).
    """

    tools: Optional[list[dict[str, Any]]] = None
    continue_final_message: bool = False
    template_kwargs: Optional[dict[str, Any]] = None


_NO_OPTIONS = ChatRenderOptions()


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    tools: Optional[list[dict[str, Any]]] = None,
    continue_final_message: bool = False,
    template_kwargs: Optional[dict[str, Any]] = None,
) -> list[int]:
    """Render ``messages`` with the chat template and tokenize the result.

    ``chat_template`` overrides the tokenizer's own. Message content may be a string or a list
    of ``{"type": "text", "text": ...}`` parts, which are joined. The rendered prompt already
    holds any special tokens the template wants, so none are added when tokenizing. The other
    arguments are :class:`ChatRenderOptions`'.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template=... (a Jinja template string).")
    options = ChatRenderOptions(tools, continue_final_message, template_kwargs)
    text = render_chat_template(tokenizer, messages, chat_template, add_generation_prompt, options)
    return encode_prompt(tokenizer, text, False)


def render_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    options: ChatRenderOptions = _NO_OPTIONS,
) -> str:
    """The prompt text the chat template makes of ``messages``; ValueError for messages it refuses."""
    normalized = normalize_messages(messages)
    template_kwargs = options.template_kwargs or {}
    _check_strings(normalized, "messages")
    _check_strings(template_kwargs, "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(
            normalized,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tools=options.tools,
            tokenize=False,
            **template_kwargs,
        )
    except jinja2.TemplateError as exc:  # raise_exception() in the template: its message is for the user
        raise ValueError(f"the chat template refused these messages: {exc}") from None
    except Exception as exc:
        raise ValueError(f"the chat template could not render these messages ({type(exc).__name__})") from exc


def _check_strings(value: Any, where: str) -> None:
    """check_text on every string inside nested lists and dicts (keys included)."""
    for text in iter_strings(value):
        check_text(text, where)


def iter_strings(value: Any) -> Iterator[str]:
    """Every string inside nested lists and dicts, keys included; iterative, so any JSON depth is fine."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check chat messages and flatten list-of-parts content into a string (ValueError if bad)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {message!r}.")
        normalized.append({**message, "content": _content_text(i, message.get("content"))})
        if message.get("tool_calls") is not None:
            normalized[-1]["tool_calls"] = _template_tool_calls(i, message["tool_calls"])
    return normalized


def _template_tool_calls(index: int, tool_calls: Any) -> list[Any]:
    """OpenAI sends tool-call arguments as JSON text; templates (Llama 3, Mistral, Qwen) expect an object, so
    arguments that parse as a JSON object are handed over parsed."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"message {index}: tool_calls must be a list.")
    result = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"message {index}: each tool call needs a function with a name.")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                function = {**function, "arguments": parsed}
        result.append({**call, "function": function})
    return result


def _content_text(index: int, content: Any) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message {index}: content must be a string or a list of text parts, got {content!r}.")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message {index}: only text content parts are supported, got a {kind!r} part.")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts
