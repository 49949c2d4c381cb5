"""/v1/chat/completions: messages -> the tokenizer's chat template -> a reply, streamed or not."""
from __future__ import annotations

import time
from typing import Iterator

import jinja2
from fastapi.responses import JSONResponse, Response

from pagedlm.entrypoints.openai.protocol import UsageInfo, random_uuid
from pagedlm.entrypoints.openai.protocol_chat import (ChatCompletionLogProbs, ChatCompletionRequest,
                                                      ChatCompletionResponse,
                                                      ChatCompletionResponseChoice,
                                                      ChatCompletionStreamChoice,
                                                      ChatCompletionStreamResponse, ChatLogProb,
                                                      ChatLogProbsContent, ChatResponseMessage,
                                                      DeltaMessage, FunctionCall, ToolCall)
from pagedlm.entrypoints.openai.prompt_worker import PromptError, render_chat
from pagedlm.entrypoints.openai.serving_engine import (_PARAMS, OpenAIServing, RequestAborted,
                                                       clean_logprob, error_response,
                                                       json_in_pieces, merge_streams,
                                                       param_from_message, prompt_logprobs_field,
                                                       sse, token_text)
from pagedlm.entrypoints.openai.serving_tools import (NO_TOOLS, ToolPlan, ToolRequestError,
                                                      constrain_to_json_schema, plan_tools)
from pagedlm.entrypoints.openai.tool_parsers import ToolParser
from pagedlm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer, tool_call_id
from pagedlm.outputs import CompletionOutput, PositionLogprobs


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        add_special_tokens: bool = False, **template_kwargs) -> dict:
    """The engine prompt for a conversation: the rendered text and its token ids, on the
    caller's thread (the server renders on its PromptWorker instead)."""
    tools = template_kwargs.pop("tools", None)
    text = render_chat(tokenizer, messages, chat_template=chat_template, tools=tools,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, variables=template_kwargs)
    # The template already holds the special tokens (BOS etc.): by default do not add them twice.
    return {"prompt": text,
            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


def _tool_finish_reason(finish_reason: str | None, tools_called: bool) -> str | None:
    return "tool_calls" if tools_called and finish_reason == "stop" else finish_reason


class OpenAIServingChat(OpenAIServing):

    def __init__(self, *args, chat_template: str | None = None,
                 tool_parser: type[ToolParser] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template  # --chat-template: overrides the tokenizer's
        self.tool_parser = tool_parser  # set with --enable-auto-tool-choice

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        if (err := self.check_generates(request.model)) is not None:
            return err
        if (err := self.refuse_request_template(request.chat_template)) is not None:
            return err
        try:
            tools = plan_tools(request, self.tool_parser)
            params = request.to_sampling_params(self.max_logprobs)
            if tools.schema is not None:
                params = constrain_to_json_schema(params, tools)
            prompt = await self.prompts.chat_prompt(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template or self.chat_template,
                tools=tools.template_tools, variables=request.chat_template_kwargs,
                add_special_tokens=request.add_special_tokens)
        except (ToolRequestError, PromptError) as e:
            return error_response(str(e), 400, e.param)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            return error_response(str(e), 400, param_from_message(str(e), _PARAMS))
        request_id = f"chatcmpl-{random_uuid()}"
        streams = await self.submit(
            request_id, [prompt], params, request.priority, request.cache_salt, request.model,
            max_tokens_field="max_completion_tokens"
            if request.max_completion_tokens is not None else "max_tokens")
        if isinstance(streams, JSONResponse):
            return streams
        model = self.model_name(request.model)
        if request.stream:
            return self.streaming_response(
                self._stream(request, request_id, model, streams, tools), streams)
        try:
            (final,) = await self.collect(streams)
        except RequestAborted:
            return self.aborted_response(request.model)
        except Exception as e:  # noqa: BLE001 - the engine failed while we waited
            return error_response(str(e) or repr(e), 500)
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        head = ChatCompletionResponse(
            id=request_id, model=model, choices=[],
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens),
            prompt_logprobs=prompt_logprobs_field(
                final.prompt_logprobs, final.prompt_token_ids, request.prompt_logprobs)
            if request.prompt_logprobs is not None else None)
        return await json_in_pieces(head, "choices",
                                    self._choices(request, tools, final.outputs))

    def _choices(self, request: ChatCompletionRequest, tools: ToolPlan,
                 outputs: list[CompletionOutput]) -> Iterator[ChatCompletionResponseChoice]:
        """The answer's choices, each built when asked for; an output is dropped from
        `outputs` once its choice is built (see json_in_pieces)."""
        for k in range(len(outputs)):
            c, outputs[k] = outputs[k], None
            message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
            if tools.make_parser is not None:
                extracted = tools.make_parser().extract_tool_calls(c.text)
                if extracted.tools_called:
                    message = ChatResponseMessage(content=extracted.content, tool_calls=[
                        ToolCall(id=tool_call_id(), function=FunctionCall(name=n, arguments=a))
                        for n, a in extracted.calls])
                finish_reason = _tool_finish_reason(finish_reason, extracted.tools_called)
            yield ChatCompletionResponseChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(request, c.token_ids, c.logprobs),
                finish_reason=finish_reason, stop_reason=c.stop_reason)

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  positions: list[PositionLogprobs] | None) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        top_n = request.top_logprobs or 0
        content = []
        for tid, pos in zip(token_ids, positions or []):
            text = token_text(self.tokenizer, tid, pos)
            top = [ChatLogProb(token=token_text(self.tokenizer, cid, pos),
                               logprob=clean_logprob(lp.logprob),
                               bytes=list(token_text(self.tokenizer, cid, pos).encode()))
                   for cid, lp in sorted(pos.items(), key=lambda kv: kv[1].rank or 0)
                   if lp.rank is not None and lp.rank <= top_n]
            content.append(ChatLogProbsContent(token=text, logprob=clean_logprob(pos[tid].logprob),
                                               bytes=list(text.encode()), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      streams, tools: ToolPlan = NO_TOOLS):
        created = int(time.time())
        # One streamer per choice turns its text deltas into content and tool-call deltas.
        streamers = None if tools.make_parser is None else {
            i: ToolCallStreamer(tools.make_parser()) for i in range(request.n)}

        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=choices, usage=usage)
                       .model_dump_json())

        prompt_tokens = completion_tokens = 0
        ended = False  # the final output came
        try:
            # The role comes first, once per choice, as OpenAI sends it.
            for i in range(request.n):
                yield chunk([ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in merge_streams(streams):
                ended = ended or out.finished
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                    if streamers is not None:
                        streamer = streamers[c.index]
                        delta = streamer.feed(c.text, final=finish_reason is not None)
                        finish_reason = _tool_finish_reason(finish_reason,
                                                            streamer.tools_called)
                        if delta is None and finish_reason is None and not (
                                request.logprobs and c.token_ids):
                            continue
                        delta = delta or DeltaMessage()
                    elif not c.text and c.finish_reason is None and not (
                            request.logprobs and c.token_ids):
                        continue
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=self._logprobs(request, c.token_ids, c.logprobs),
                        finish_reason=finish_reason, stop_reason=c.stop_reason)])
            if not ended:
                yield self.aborted_event(request.model)
            elif request.include_usage:
                yield chunk([], UsageInfo(prompt_tokens=prompt_tokens,
                                          completion_tokens=completion_tokens,
                                          total_tokens=prompt_tokens + completion_tokens))
        except Exception as e:  # noqa: BLE001 - report it in the stream, then end it
            yield self.stream_error(e)
        finally:
            self.abort(streams)
        yield sse("[DONE]")
