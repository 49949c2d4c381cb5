"""/v1/completions: prompts (text or token ids, one or a batch) -> completions, streamed or not."""
from __future__ import annotations

import time
from typing import Iterator

from fastapi.responses import JSONResponse, Response

from pagedlm.entrypoints.openai.protocol import UsageInfo, random_uuid
from pagedlm.entrypoints.openai.protocol_completion import (CompletionLogProbs, CompletionRequest,
                                                            CompletionResponse,
                                                            CompletionResponseChoice,
                                                            CompletionStreamResponse)
from pagedlm.entrypoints.openai.prompt_worker import PromptError
from pagedlm.entrypoints.openai.serving_engine import (MAX_PROMPTS, _PARAMS, OpenAIServing,
                                                       RequestAborted, clean_logprob,
                                                       error_response, json_in_pieces,
                                                       merge_streams, param_from_message,
                                                       prompt_logprobs_field, sse, token_text)
from pagedlm.inputs.preprocess import PromptType
from pagedlm.outputs import PositionLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest) -> Response:
        if (err := self.check_generates(request.model)) is not None:
            return err
        try:
            params = request.to_sampling_params(self.max_logprobs)
            prompts = await self._prompts(request)
        except PromptError as e:
            return error_response(str(e), 400, e.param)
        except ValueError as e:
            return error_response(str(e), 400, param_from_message(str(e), _PARAMS))
        request_id = f"cmpl-{random_uuid()}"
        streams = await self.submit(request_id, prompts, params, request.priority,
                                    request.cache_salt, request.model)
        if isinstance(streams, JSONResponse):
            return streams
        model = self.model_name(request.model)
        if request.stream:
            return self.streaming_response(
                self._stream(request, request_id, model, streams), streams)
        try:
            finals = await self.collect(streams)
        except RequestAborted:
            return self.aborted_response(request.model)
        except Exception as e:  # noqa: BLE001 - the engine failed while we waited
            return error_response(str(e) or repr(e), 500)
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        head = CompletionResponse(id=request_id, model=model, choices=[], usage=UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens))
        return await json_in_pieces(head, "choices", self._choices(request, finals))

    async def _prompts(self, request: CompletionRequest) -> list[PromptType]:
        p = request.prompt
        if isinstance(p, str):
            texts, id_lists = [p], None
        elif not p:
            raise ValueError("prompt must not be empty.")
        elif isinstance(p[0], str):
            texts, id_lists = p, None
        elif isinstance(p[0], int):
            texts, id_lists = None, [p]
        else:
            texts, id_lists = None, p
        if len(texts or id_lists) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(texts or id_lists)} prompts; at most "
                             f"{MAX_PROMPTS} are accepted in one request.")
        if texts is not None:
            ids = await self.prompts.encode(texts, request.add_special_tokens, "prompt")
            return [{"prompt": t, "prompt_token_ids": i} for t, i in zip(texts, ids)]
        return [{"prompt_token_ids": list(ids)} for ids in id_lists]

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(
            out.prompt_token_ids)

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                  offset: int) -> CompletionLogProbs:
        """The legacy format: tokens, their logprobs, the top alternatives, text offsets."""
        lp = CompletionLogProbs()
        for tid, pos in zip(token_ids, positions):
            text = token_text(self.tokenizer, tid, pos)
            lp.tokens.append(text)
            lp.text_offset.append(offset)
            offset += len(text)
            if pos is None:  # the first prompt token: nothing to score it against
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(clean_logprob(pos[tid].logprob))
            top = {}
            for cand_id, cand in sorted(pos.items(), key=lambda kv: kv[1].rank or 0):
                top.setdefault(token_text(self.tokenizer, cand_id, pos),
                               clean_logprob(cand.logprob))
            lp.top_logprobs.append(top)
        return lp

    def _choices(self, request: CompletionRequest, finals: list[RequestOutput]
                 ) -> Iterator[CompletionResponseChoice]:
        """The answer's choices in index order, each built when asked for; a prompt's output
        is dropped from `finals` once its choices are built (see json_in_pieces)."""
        for i in range(len(finals)):
            out, finals[i] = finals[i], None
            prompt_text = self._prompt_text(out) if request.echo else ""
            prompt_logprobs = prompt_logprobs_field(
                out.prompt_logprobs, out.prompt_token_ids, request.prompt_logprobs) \
                if request.prompt_logprobs is not None else None
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if request.logprobs is not None:
                    ids, positions = list(c.token_ids), list(c.logprobs or [])
                    if request.echo:
                        ids = list(out.prompt_token_ids) + ids
                        positions = list(out.prompt_logprobs or
                                         [None] * len(out.prompt_token_ids)) + positions
                    logprobs = self._logprobs(ids, positions, 0)
                yield CompletionResponseChoice(
                    index=i * request.n + c.index, text=prompt_text + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs)

    async def _stream(self, request: CompletionRequest, request_id: str, model: str, streams):
        created = int(time.time())
        n = request.n
        # Choice index -> where its next token's text starts (text_offset): the tokens' own
        # texts, not the characters sent, which lag them while a stop string may still cut.
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        ended: set[int] = set()  # prompts whose final output came
        try:
            async for i, out in merge_streams(streams):
                if out.finished:
                    ended.add(i)
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    text, ids, positions = c.text, list(c.token_ids), list(c.logprobs or [])
                    if index not in offsets:
                        offsets[index] = 0
                        if request.echo:
                            text = self._prompt_text(out) + text
                            ids = list(out.prompt_token_ids) + ids
                            positions = list(out.prompt_logprobs or
                                             [None] * len(out.prompt_token_ids)) + positions
                    wants_lp = request.logprobs is not None
                    if not text and c.finish_reason is None and not (wants_lp and ids):
                        continue  # nothing new to say (text held back, or partial UTF-8)
                    logprobs = self._logprobs(ids, positions, offsets[index]) if wants_lp \
                        else None
                    if logprobs is not None and logprobs.tokens:
                        offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionResponseChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                    yield sse(chunk.model_dump_json())
            if len(ended) < len(streams):
                yield self.aborted_event(request.model)
            elif request.include_usage:
                p = sum(prompt_tokens.values())
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=p, completion_tokens=completion_tokens,
                                    total_tokens=p + completion_tokens))
                yield sse(chunk.model_dump_json())
        except Exception as e:  # noqa: BLE001 - report it in the stream, then end it
            yield self.stream_error(e)
        finally:
            self.abort(streams)
        yield sse("[DONE]")
