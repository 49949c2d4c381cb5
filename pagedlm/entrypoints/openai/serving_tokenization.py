"""/tokenize and /detokenize in vLLM's shapes: a prompt or a chat conversation -> token ids
(with the server's tokenizer and chat template), token ids -> text."""
from __future__ import annotations

import jinja2
from fastapi.responses import JSONResponse, Response

from pagedlm.entrypoints.openai.protocol_tokenization import (DetokenizeRequest, DetokenizeResponse,
                                                              TokenizeChatRequest,
                                                              TokenizeCompletionRequest,
                                                              TokenizeResponse)
from pagedlm.entrypoints.openai.prompt_worker import (MAX_CHARS_PER_TOKEN, PromptError,
                                                      max_prompt_chars)
from pagedlm.entrypoints.openai.serving_engine import OpenAIServing, error_response
from pagedlm.entrypoints.openai.serving_tools import (ToolRequestError, check_tool_messages,
                                                      check_tools)


class OpenAIServingTokenization(OpenAIServing):

    def __init__(self, *args, chat_template: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template  # --chat-template, as chat completions render

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> Response:
        if (err := self.check_model(request.model)) is not None:
            return err
        if isinstance(request, TokenizeChatRequest):
            if (err := self.refuse_request_template(request.chat_template)) is not None:
                return err
            if request.add_generation_prompt and request.continue_final_message:
                return error_response("add_generation_prompt and continue_final_message "
                                      "cannot both be true.", 400, "continue_final_message")
            try:  # as chat completions check them, so the error names the same field
                check_tool_messages(request.messages)
                check_tools(request.tools)
            except ToolRequestError as e:
                return error_response(str(e), 400, e.param)
            tools = ([t.model_dump(exclude_none=True) for t in request.tools]
                     if request.tools else None)
            try:
                ids = (await self.prompts.chat_prompt(
                    request.messages, add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    chat_template=request.chat_template or self.chat_template, tools=tools,
                    variables=request.chat_template_kwargs,
                    add_special_tokens=request.add_special_tokens))["prompt_token_ids"]
            except PromptError as e:
                return error_response(str(e), 400, e.param)
            except (ValueError, TypeError, jinja2.TemplateError) as e:
                param = "messages" if str(e).startswith("messages") else "chat_template"
                return error_response(f"Cannot apply the chat template: {e}", 400, param)
        else:
            try:
                (ids,) = await self.prompts.encode([request.prompt], request.add_special_tokens,
                                                   "prompt")
            except PromptError as e:
                return error_response(str(e), 400, e.param)
        strs = await self.prompts.convert_ids_to_tokens(ids) if request.return_token_strs \
            else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=self.max_model_len,
                                             tokens=ids, token_strs=strs).model_dump())

    async def detokenize(self, request: DetokenizeRequest) -> Response:
        if (err := self.check_model(request.model)) is not None:
            return err
        # As many ids as the longest text /tokenize takes could give: the bound keeps the
        # checks below and the decoded text's response (a 4M-id list decoded to 40 MB, held
        # the event loop for 1 s) small.
        limit = max_prompt_chars(self.max_model_len)
        if len(request.tokens) > limit:
            return error_response(f"tokens has {len(request.tokens)} ids; at most {limit} are "
                                  f"accepted (max_model_len {self.max_model_len} x "
                                  f"{MAX_CHARS_PER_TOKEN}, the longest text /tokenize takes).",
                                  400, "tokens")
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(f"tokens contains ids outside the tokenizer's vocabulary "
                                  f"[0, {vocab}): {bad[:5]}.", 400, "tokens")
        return JSONResponse(DetokenizeResponse(
            prompt=await self.prompts.decode(request.tokens)).model_dump())
