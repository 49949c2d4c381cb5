"""/v1/embeddings: texts or token arrays -> one pooled vector each (a --runner pooling server)."""
from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse, Response

from pagedlm.engine.async_llm_engine import AsyncEngineDeadError, LoRANotServedError
from pagedlm.engine.request_stream import RequestStream
from pagedlm.entrypoints.openai.protocol import random_uuid
from pagedlm.entrypoints.openai.protocol_embedding import (EmbeddingData, EmbeddingRequest,
                                                           EmbeddingResponse, EmbeddingUsage)
from pagedlm.entrypoints.openai.prompt_worker import PromptError
from pagedlm.entrypoints.openai.serving_engine import (MAX_PROMPTS, AddFailed, OpenAIServing,
                                                       RequestAborted, error_response,
                                                       json_in_pieces, not_served)
from pagedlm.inputs.preprocess import PromptType
from pagedlm.outputs import EmbeddingRequestOutput
from pagedlm.pooling_params import PoolingParams

def encode_base64(embedding: list[float]) -> str:
    """OpenAI's base64 format: the little-endian float32 bytes."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):

    async def create_embedding(self, request: EmbeddingRequest) -> Response:
        if (err := self.check_model(request.model)) is not None:
            return err
        if self.engine.model_config.runner != "pooling":
            return error_response("This server generates text: embeddings need a server "
                                  "started with `--runner pooling`.", 400, "model")
        try:
            prompts = await self._prompts(request)
            params = PoolingParams(normalize=request.normalize, dimensions=request.dimensions)
        except PromptError as e:
            return error_response(str(e), 400, e.param)
        except ValueError as e:
            where = str(e).split(" ", 1)[0].rstrip(":")
            return error_response(str(e), 400, where if where.startswith(("dimensions", "input["))
                                  else "input")
        request_id = f"embd-{random_uuid()}"
        streams = await self._submit(request_id, prompts, params, request)
        if isinstance(streams, JSONResponse):
            return streams
        try:
            finals: list[EmbeddingRequestOutput] = await self.collect(streams)
        except RequestAborted:
            return self.aborted_response(request.model)
        except Exception as e:  # noqa: BLE001 - the engine failed while we waited
            return error_response(str(e) or repr(e), 500)
        data = []
        for i, out in enumerate(finals):
            if out is None or not out.outputs.embedding:
                return error_response("The request was aborted before its embedding was "
                                      "computed.", 500)
            vec = out.outputs.embedding
            data.append(EmbeddingData(index=i, embedding=encode_base64(vec)
                                      if request.encoding_format == "base64" else vec))
        num_tokens = sum(len(out.prompt_token_ids) for out in finals)
        return await json_in_pieces(EmbeddingResponse(
            id=request_id, model=self.model_name(request.model), data=[],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)), "data", data)

    async def _submit(self, request_id: str, prompts: list[PromptType], params: PoolingParams,
                      request: EmbeddingRequest) -> list[RequestStream] | JSONResponse:
        """One engine request per input, all or nothing; the engine's errors name `input`
        (the prompt) or `dimensions`."""
        if isinstance(adapter := self.adapter(request.model), JSONResponse):
            return adapter
        lora, served = adapter
        try:
            return await self.add_all(request_id, prompts, lambda rid, prompt: (
                self.engine.add_request(rid, prompt, params, priority=request.priority,
                                        lora_request=lora, lora_served=served)))
        except LoRANotServedError:
            return not_served(request.model)
        except AddFailed as failed:
            msg = str(failed.cause)
            param = next((f for f in ("dimensions", "priority") if msg.startswith(f)), "input")
            if len(prompts) > 1 and param == "input":
                msg, param = f"input[{failed.index}]: {msg}", f"input[{failed.index}]"
            return error_response(msg, 400, param)
        except AsyncEngineDeadError as e:
            return error_response(str(e), 500)

    async def _prompts(self, request: EmbeddingRequest) -> list[PromptType]:
        x = request.input
        if isinstance(x, str):
            texts, id_lists = [x], None
        elif not x:
            raise ValueError("input must not be empty.")
        elif isinstance(x[0], str):
            texts, id_lists = x, None
        elif isinstance(x[0], int):
            texts, id_lists = None, [x]
        else:
            texts, id_lists = None, x
        if len(texts or id_lists) > MAX_PROMPTS:
            raise ValueError(f"input holds {len(texts or id_lists)} inputs; at most "
                             f"{MAX_PROMPTS} are accepted in one request.")
        if texts is not None:
            ids = await self.prompts.encode(texts, request.add_special_tokens, "input")
            prompts = [{"prompt": t, "prompt_token_ids": i} for t, i in zip(texts, ids)]
        else:
            prompts = [{"prompt_token_ids": list(ids)} for ids in id_lists]
        # Every input checked before any is added: one refused by the engine after the others
        # were added left them computed for nobody (64 of 2,047 embeddings, measured).
        vocab = self.engine.model_config.vocab_size
        for i, p in enumerate(prompts):
            where = f"input[{i}]" if len(prompts) > 1 else "input"
            ids = p["prompt_token_ids"]
            if not ids:
                raise ValueError(f"{where} is empty: it must have at least one token.")
            if len(ids) > self.max_model_len:
                raise ValueError(f"{where}: prompt is too long: {len(ids)} tokens, but "
                                 f"max_model_len is {self.max_model_len}.")
            # min and max: C loops, a few ms for a body's 2^19 ids on the event loop.
            if texts is None and (min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"{where} contains token ids outside the vocabulary "
                                 f"[0, {vocab}): {[t for t in ids if not 0 <= t < vocab][:5]}.")
        return prompts
