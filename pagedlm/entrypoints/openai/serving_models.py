"""The models the server answers to: the base model's names and LoRA adapters by name.

Adapters come from `--lora-modules` at start-up and, with runtime updating enabled, from
POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A request's `model` names either the
base model or an adapter; /v1/models lists adapters with the base model as their parent.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import unicodedata
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.openai.protocol import ModelCard
from pagedlm.entrypoints.openai.serving_engine import error_response
from pagedlm.lora.request import LoRARequest


# The longest adapter name /v1/load_lora_adapter accepts (a Hugging Face repo id is at most 96).
MAX_LORA_NAME = 256


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def name_problem(name: str) -> str | None:
    """Why an adapter name cannot be served, or None. /metrics' lora_requests_info lists names
    joined by commas (vLLM's label), and a control character breaks logs and the page."""
    if any(c == "," or unicodedata.category(c)[0] == "C" for c in name):
        return (f"lora_name {name[:80]!r} holds a comma or a control character; /metrics "
                f"lists adapter names separated by commas.")
    return None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r}: {e}")
        if (not isinstance(value, dict) or not isinstance(value.get("name"), str)
                or not isinstance(value.get("path"), str)
                or set(value) - {"name", "path", "base_model_name"}):
            raise argparse.ArgumentTypeError(
                f"--lora-modules: expected {{\"name\": ..., \"path\": ..., "
                f"\"base_model_name\": ...}}, got {text!r}")
        module = LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or JSON, got "
                                             f"{text!r}")
        module = LoRAModulePath(name, path)
    if (problem := name_problem(module.name)) is not None:
        raise argparse.ArgumentTypeError(f"--lora-modules: {problem}")
    return module


class OpenAIServingModels:

    def __init__(self, engine: AsyncLLMEngine, base_model_names: list[str],
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()

    async def init_static_loras(self) -> None:
        """Load the --lora-modules adapters; a bad one stops the server with its error."""
        for module in self.static_lora_modules:
            err = await self.load_lora(module.name, module.path, module.base_model_name)
            if err is not None:
                raise ValueError(f"--lora-modules {module.name}: "
                                 f"{json.loads(err.body)['error']['message']}")

    def is_base_model(self, model: str | None) -> bool:
        return model is None or model in self.base_model_names

    def check(self, model: str | None) -> JSONResponse | None:
        if self.is_base_model(model) or model in self.lora_requests:
            return None
        return error_response(f"The model `{model}` does not exist.", 404, "model")

    def lora_for(self, model: str | None) -> LoRARequest | None:
        return None if self.is_base_model(model) else self.lora_requests.get(model)

    def cards(self) -> list[ModelCard]:
        mc = self.engine.model_config
        cards = [ModelCard(id=name, root=mc.model_dir, max_model_len=mc.max_model_len)
                 for name in self.base_model_names]
        cards += [ModelCard(id=name, root=req.lora_path, max_model_len=mc.max_model_len,
                            parent=req.base_model_name or self.base_model_names[0])
                  for name, req in self.lora_requests.items()]
        return cards

    async def load_lora(self, name: object, path: object,
                        base_model_name: object = None) -> JSONResponse | None:
        """None on success, else the error response (400 naming the field)."""
        if self.engine.engine.config.lora_config is None:
            return error_response("LoRA is disabled: start the server with --enable-lora.",
                                  400, "lora_name")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                return error_response(f"{field} must be a non-empty string, got {value!r}.",
                                      400, field)
        if len(name) > MAX_LORA_NAME:
            # A name is echoed in every /v1/models listing and in every error naming it.
            return error_response(f"lora_name is {len(name)} characters long; at most "
                                  f"{MAX_LORA_NAME} are accepted.", 400, "lora_name")
        if (problem := name_problem(name)) is not None:
            return error_response(problem, 400, "lora_name")
        if base_model_name is not None and base_model_name not in self.base_model_names:
            return error_response(f"base_model_name {base_model_name!r} is not one of "
                                  f"{self.base_model_names}.", 400, "base_model_name")
        async with self._lock:
            if name in self.lora_requests or name in self.base_model_names:
                return error_response(f"lora_name {name!r} is already in use.", 400,
                                      "lora_name")
            req = LoRARequest(name, self._next_id, path, base_model_name)
            try:
                await self.engine.add_lora(req)
            except ValueError as e:  # the adapter at lora_path does not fit
                return error_response(str(e), 400, "lora_path")
            self._next_id += 1
            self.lora_requests[name] = req
        return None

    async def unload_lora(self, name: object) -> JSONResponse | None:
        if not isinstance(name, str) or not name:
            return error_response(f"lora_name must be a non-empty string, got {name!r}.", 400,
                                  "lora_name")
        async with self._lock:
            req = self.lora_requests.pop(name, None)
            if req is None:
                return error_response(f"The LoRA adapter `{name}` does not exist.", 404,
                                      "lora_name")
            await self.engine.remove_lora(req.lora_int_id)
        return None
