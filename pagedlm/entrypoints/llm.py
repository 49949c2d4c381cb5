"""LLM: the offline entry point (vLLM's API): generate() and chat() over an LLMEngine, and beam
search above it (entrypoints/beam_search.py)."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

import jinja2
from tqdm.auto import tqdm

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.beam_search import BeamSearchDriver
from pagedlm.inputs.preprocess import PromptType
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import (BeamSearchOutput, BeamSearchSequence, EmbeddingRequestOutput,
                             RequestOutput)
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedlm.transformers_utils.chat_template import chat_conversations, load_chat_template
from pagedlm.utils import run_through_ctrl_c

ChatMessages = list[dict]


class LLM:
    """Load a model and generate from it. `LLM()` runs the embedded SmolLM2-135M-Instruct.

    Engine settings (max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_memory_bytes, num_gpu_blocks_override, gpu_memory_utilization, enforce_eager,
    ...) are keyword arguments, as in vLLM. device: "cpu" (default), "cuda", "cuda:N", "auto".
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", seed: int = 0,
                 device: str = "cpu", **engine_kwargs) -> None:
        try:
            args = EngineArgs(model=model, dtype=dtype, seed=seed, device=device,
                              **engine_kwargs)
        except TypeError as e:
            raise TypeError(f"LLM(): {e}") from None
        self.llm_engine = LLMEngine.from_engine_args(args)
        # Stepped in the engine's place: use_beam_search requests run as searches over it.
        self._driver = BeamSearchDriver(self.llm_engine)
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop worker processes (tensor or pipeline parallelism); also on `del`, at the end of a
        `with LLM(...) as llm:` block, and at interpreter exit."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """On a pooling engine (runner='pooling') only embed() works: this raises ValueError.
        priority: one per prompt (lower runs first), with scheduling_policy='priority'.
        lora_request: one adapter for every prompt, or one (or None) per prompt; needs
        enable_lora=True."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict, or a list of them, got "
                             f"{type(prompts).__name__}.")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):  # a dict's keys, a string's letters
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}.")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries but there are "
                                 f"{len(prompts)} prompts; pass one, or one per prompt.")
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are "
                             f"{len(prompts)} prompts; pass one per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif not isinstance(lora_request, (list, tuple)):
            raise ValueError(f"lora_request must be a LoRARequest, or a list of them (or None) "
                             f"per prompt, got {type(lora_request).__name__}.")
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request has {len(loras)} entries but there are "
                                 f"{len(prompts)} prompts; pass one, or one per prompt.")
        self._add_requests(prompts, params, list(priority), loras)
        try:
            return self._run_engine(use_tqdm)
        except BaseException:
            # Ctrl-C (or a failed step), from the moment the requests are queued: they are
            # dropped, or the next call would run them and return their outputs with its own.
            run_through_ctrl_c(self._driver.abort_all)
            raise

    def embed(self, prompts: PromptType | Seq[PromptType],
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool = True,
              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), pooled from the model's final
        hidden states as the engine's pooler_config says; needs runner='pooling'."""
        if not self.llm_engine.is_pooling:
            raise ValueError("LLM.embed needs an engine started with runner='pooling', e.g. "
                             "LLM(model, runner='pooling'); this one generates text.")
        if pooling_params is None:
            pooling_params = PoolingParams()
        if (isinstance(pooling_params, (list, tuple)) and not isinstance(prompts, (str, dict))
                and len(pooling_params) != len(prompts)):
            raise ValueError(f"pooling_params has {len(pooling_params)} entries but there are "
                             f"{len(prompts)} prompts; pass one, or one per prompt.")
        return self.generate(prompts, pooling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt; each output holds beam_width beams, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        results = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        tokenizer = self.get_tokenizer()
        outputs = []
        for r in results:
            beams = []
            for c in r.outputs:
                tokens = list(r.prompt_token_ids) + list(c.token_ids)
                beams.append(BeamSearchSequence(tokens, tokenizer.decode(tokens),
                                                c.cumulative_logprob, c.finish_reason))
            outputs.append(BeamSearchOutput(beams))
        return outputs

    def chat(self, messages: ChatMessages | Seq[ChatMessages],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them; content
        is text or a list of text parts. chat_template: a Jinja template, or a file holding
        one (as `pagedlm serve --chat-template`); None: the tokenizer's."""
        conversations = chat_conversations(messages)
        if chat_template is not None:
            chat_template = load_chat_template(chat_template)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be a bool, got "
                             f"{add_generation_prompt!r}.")
        tokenizer = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            try:
                text = tokenizer.apply_chat_template(
                    conv, chat_template=chat_template, tokenize=False,
                    add_generation_prompt=add_generation_prompt)
            except (jinja2.TemplateError, TypeError) as e:
                raise ValueError(f"chat_template: rendering the conversation failed: "
                                 f"{type(e).__name__}: {e}") from None
            # The template already holds the special tokens (BOS etc.): do not add them twice.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _add_requests(self, prompts: list[PromptType], params: list[SamplingParams],
                      priority: list[int], loras: list[LoRARequest | None] | None = None
                      ) -> None:
        added = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, loras):
                if isinstance(p, SamplingParams):
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY  # generate() returns finals
                elif not isinstance(p, PoolingParams):
                    raise ValueError(f"sampling_params entries must be SamplingParams, got "
                                     f"{type(p).__name__}.")
                request_id = str(next(self.request_counter))
                added.append(request_id)  # first: a Ctrl-C may come as soon as it is queued
                self._driver.add_request(request_id, prompt, p, priority=prio,
                                         lora_request=lora)
        except BaseException:
            # All or nothing: a bad prompt, or a Ctrl-C, must not leave the earlier ones
            # queued (the next call ran them and returned their outputs with its own).
            run_through_ctrl_c(lambda: self._driver.abort_request(added))
            raise

    def _run_engine(self, use_tqdm: bool) -> list[RequestOutput]:
        engine = self._driver
        total = engine.get_num_unfinished_requests()
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        outputs: list[RequestOutput] = []
        try:
            self._step_until_done(engine, bar, outputs)
        finally:
            bar.close()
        # Requests finish out of order; hand them back in the order they were given.
        return sorted(outputs, key=lambda o: int(o.request_id))

    @staticmethod
    def _step_until_done(engine, bar, outputs: list) -> None:
        in_toks = out_toks = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                outputs.append(out)
                in_toks += len(out.prompt_token_ids)
                if isinstance(out, RequestOutput):
                    out_toks += sum(len(c.token_ids) for c in out.outputs)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.postfix = (f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                               f"output: {out_toks / elapsed:.2f} toks/s")
                bar.update(1)
