"""Chat templates and conversations as the offline API and the command line take them: a
template given as a file or as its text, and conversations checked before a template sees
them, so that a mistake is a ValueError naming the message and field, not a Jinja error from
inside the template."""
from __future__ import annotations

import os


def load_chat_template(text: str, field: str = "chat_template") -> str:
    """A file's contents, or `text` itself if it is a Jinja template; either must compile."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"{field} must be a Jinja template or a file holding one, got "
                         f"{text!r}.")
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{field}: cannot read {text!r}: {e}") from None
    elif "{{" not in text and "{%" not in text:
        raise ValueError(f"{field}: no such file, and not a Jinja template: {text[:200]!r}")
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        raise ValueError(f"{field} does not compile: {e}") from None
    return text


def chat_conversations(messages) -> list[list[dict]]:
    """LLM.chat's `messages` (one conversation, or a list of them) as conversations of
    {"role", "content", ...} dicts whose content is text: a list of text parts (OpenAI's form)
    is joined with newlines, as the server joins it; None is empty."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a conversation (a non-empty list of "
                         f"{{'role', 'content'}} dicts) or a list of them, got "
                         f"{type(messages).__name__ if messages else repr(messages)}.")
    many = not isinstance(messages[0], dict)
    conversations = messages if many else [messages]
    out = []
    for c, conv in enumerate(conversations):
        where = f"messages[{c}]" if many else "messages"
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} "
                             f"dicts, got {conv!r:.80}.")
        out.append([_message(m, f"{where}[{i}]") for i, m in enumerate(conv)])
    return out


def _message(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got "
                         f"{type(m).__name__}.")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string, got {role!r:.80}.")
    content = m.get("content")
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}.content[{j}] must be a text part "
                                 f"({{'type': 'text', 'text': ...}}); other parts are not "
                                 f"supported, got {part!r:.80}.")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got "
                         f"{type(content).__name__}.")
    return {**m, "content": content}
