"""Chat templates and tokenization, off the event loop and bounded.

Tokenizing is linear in a prompt's length, and a chat template is a program (a request-supplied
one, with --trust-request-chat-template, can loop as long as it likes): both run on one worker
thread, never on the event loop, so /health and every other request keep answering meanwhile.
One thread keeps prompts in arrival order. Its tokenizer is shared with the engine thread and
the event loop where that is safe (transformers_utils/tokenizer.py's thread_tokenizer).

Bounds: a prompt longer than max_model_len x MAX_CHARS_PER_TOKEN characters is refused before
it is tokenized; a template's output is counted as it renders and cut off at that length; a
render that runs past RENDER_TIMEOUT_S is stopped.
"""
from __future__ import annotations

import asyncio
import functools
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

from pagedlm.entrypoints.openai.protocol import ChatMessage
from pagedlm.transformers_utils.tokenizer import thread_tokenizer

# A prompt can only be useful up to max_model_len tokens, so text past max_model_len x 16
# characters is refused untokenized. Real text averages 3 to 4 characters a token (measured with
# the default model's tokenizer: this repository's README 3.0, its Python 3.8), so 16 leaves 4x
# headroom. Single tokens reach 64 to 81 characters (runs of spaces, '#' or '='): a prompt made
# of little else might fit and is still refused, which is the price of a bound that needs no
# tokenizing.
MAX_CHARS_PER_TOKEN = 16
# A chat template renders a conversation in milliseconds; this stops a (trusted, request-
# supplied) template that loops without writing anything, which the output bound cannot catch.
RENDER_TIMEOUT_S = 2.0
# transformers' marker for continue_final_message, so the result matches its apply_chat_template.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class PromptError(ValueError):
    """A prompt or conversation the server refuses: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def max_prompt_chars(max_model_len: int) -> int:
    return max_model_len * MAX_CHARS_PER_TOKEN


def too_long_message(what: str, max_model_len: int, length: int | None = None) -> str:
    limit = max_prompt_chars(max_model_len)
    why = (f"(max_model_len {max_model_len} tokens x {MAX_CHARS_PER_TOKEN} characters a "
           f"token)")
    if length is None:
        return f"{what} is longer than {limit} characters, the most accepted {why}."
    return f"{what} is too long: {length} characters, but at most {limit} are accepted {why}."


def _deadline_tracer(deadline: float, what: str) -> Callable:
    """A sys.settrace function stopping compiled Jinja code (its frames' file is "<template>")
    once time.monotonic() passes `deadline`; other frames are not traced line by line."""
    def local(frame, event, _arg):
        if event == "line" and time.monotonic() > deadline:
            raise PromptError(f"{what} took longer than {RENDER_TIMEOUT_S:g} s to render: it "
                              f"was stopped.", "chat_template")
        return local

    def on_call(frame, _event, _arg):
        return local if frame.f_code.co_filename == "<template>" else None
    return on_call


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, variables: dict[str, Any] | None = None,
                max_model_len: int | None = None, timeout_s: float | None = None) -> str:
    """The conversation rendered as transformers' apply_chat_template(tokenize=False) renders
    it (same template choice, compiled template, variables and continue_final_message cut), but
    through the template's generator. `variables` are extra template variables (a request's
    chat_template_kwargs): they cannot replace messages, tools or add_generation_prompt.
    Past max_prompt_chars(max_model_len) characters, or
    timeout_s seconds, the render stops with a PromptError. Any other failure of the template
    is a ValueError, TypeError or jinja2.TemplateError."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
    if not messages:
        raise ValueError("messages must not be empty.")
    template = tokenizer.get_chat_template(chat_template, tools)
    compiled = _compile_jinja_template(template)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    final_text = None
    if continue_final_message:
        final_text = messages[-1].get("content")
        if not isinstance(final_text, str):
            raise ValueError("continue_final_message: the final message has no text content "
                             "to continue.")
        if "content" not in template:
            raise ValueError("continue_final_message: the chat template does not read the "
                             "messages' content.")
        messages[-1] = {**messages[-1], "content": final_text + _CONTINUE_TAG}
    what = "the chat template" if chat_template is None else "the request's chat template"
    context = {**tokenizer.special_tokens_map, **(variables or {}), "messages": messages,
               "tools": tools, "documents": None, "add_generation_prompt": add_generation_prompt}
    max_chars = max_prompt_chars(max_model_len) if max_model_len is not None else None
    pieces: list[str] = []
    length = 0
    previous_trace = sys.gettrace()
    if timeout_s is not None:
        sys.settrace(_deadline_tracer(time.monotonic() + timeout_s, what))
    try:
        stream = compiled.generate(context)
        try:
            for piece in stream:
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise PromptError(too_long_message(
                        "messages: the conversation rendered by the chat template",
                        max_model_len), "messages")
                pieces.append(piece)
        finally:
            stream.close()
    except RecursionError:
        raise PromptError(f"{what} recursed too deeply.", "chat_template") from None
    except (ValueError, TypeError, jinja2.TemplateError):
        raise
    except Exception as e:  # noqa: BLE001 - e.g. OverflowError from range(): the template's
        raise PromptError(f"{what} failed: {e!r}", "chat_template") from e
    finally:
        sys.settrace(previous_trace)
    text = "".join(pieces)
    if final_text is not None:
        tag = text.rfind(_CONTINUE_TAG.strip())
        if tag < 0 or final_text.strip() not in text:
            raise ValueError("continue_final_message: the final message does not appear in the "
                             "chat rendered by the chat template.")
        # The template may strip the message's trailing space along with the tag's.
        text = text[:tag] if text.startswith(_CONTINUE_TAG, tag) else text[:tag].rstrip()
    return text


def template_dicts(messages: Sequence[ChatMessage]) -> list[dict]:
    """The messages as the template reads them; deeply nested tool-call arguments are a
    PromptError (not a RecursionError: a 400, not a 500)."""
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(m.to_template_dict(i))
        except RecursionError:
            raise PromptError(f"messages[{i}].tool_calls: the arguments are nested too deeply.",
                              f"messages.{i}.tool_calls") from None
        except ValueError as e:  # a content part it cannot take, named first in the message
            path = str(e).split(":", 1)[0]
            raise PromptError(str(e), path if path.startswith(f"messages.{i}.")
                              else f"messages.{i}") from None
    return out


class PromptWorker:
    """Renders and tokenizes prompts on one thread (see the module docstring). Every method
    refuses an over-long prompt before doing any work."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = thread_tokenizer(tokenizer)
        self.max_model_len = max_model_len
        self.max_chars = max_prompt_chars(max_model_len)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-prompts")

    async def _run(self, fn: Callable, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs))

    def check_length(self, text: str, param: str, what: str = "prompt") -> None:
        if len(text) > self.max_chars:
            raise PromptError(too_long_message(what, self.max_model_len, len(text)), param)

    async def encode(self, texts: Sequence[str], add_special_tokens: bool,
                     param: str) -> list[list[int]]:
        """Each text's token ids. All are checked first (nothing is tokenized if one is too
        long); then one job each, so other requests' prompts interleave with a long batch."""
        for i, text in enumerate(texts):
            self.check_length(text, param if len(texts) == 1 else f"{param}.{i}",
                              param if len(texts) == 1 else f"{param}[{i}]")
        return [await self._run(self.tokenizer.encode, text,
                                add_special_tokens=add_special_tokens) for text in texts]

    async def chat_prompt(self, messages: Sequence[ChatMessage], *, add_special_tokens: bool,
                          **render_kwargs: Any) -> dict:
        """The engine prompt for a conversation: rendered text and token ids. render_kwargs are
        render_chat's (chat_template, tools, add_generation_prompt, continue_final_message,
        variables); the template already holds the special tokens, so add_special_tokens is
        usually False."""
        return await self._run(self._chat_prompt, messages, add_special_tokens, render_kwargs)

    def _chat_prompt(self, messages: Sequence[ChatMessage], add_special_tokens: bool,
                     render_kwargs: dict) -> dict:
        text = render_chat(self.tokenizer, template_dicts(messages),
                           max_model_len=self.max_model_len, timeout_s=RENDER_TIMEOUT_S,
                           **render_kwargs)
        return {"prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text,
                                                          add_special_tokens=add_special_tokens)}

    async def decode(self, ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, ids)

    async def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return await self._run(self.tokenizer.convert_ids_to_tokens, ids)

    def shutdown(self) -> None:
        """Queued jobs are dropped; one already running finishes on its own (bounded)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
