"""Command-line flags: engine settings generated from the EngineArgs dataclass, server settings.

Every EngineArgs field becomes `--field-name` (vLLM's spelling), typed from its annotation;
bool fields get `--flag/--no-flag`. A field added to EngineArgs later gets its flag without
changes here (its help text comes from _HELP, else from the comment after the field).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import json
import re
import types
import typing

from pagedlm import envs
from pagedlm.config import EXECUTOR_BACKENDS, HASH_ALGOS, KV_CACHE_DTYPES
from pagedlm.engine.arg_utils import EngineArgs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# vLLM sets no limit; 32 MiB holds any prompt a long-context model takes (as text or token ids)
# many times over while keeping a hostile body's memory small.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
# pydantic parses a body holding the GIL throughout, so that no thread (the event loop's, the
# engine's) runs meanwhile: about 0.3-0.4 us a JSON value inside the prompt's union type (Zen 4
# EPYC: 4M token ids, 8 MB, 1.0-1.6 s; a 24 MB body of 12M ids held /health for 4.3-4.9 s,
# from a worker thread as from the loop). Bounding the values (counted as commas, before
# parsing) bounds that pause at about 0.2 s. 2^19 ids are 64 prompts of 8,192 tokens.
DEFAULT_MAX_REQUEST_BODY_VALUES = 2**19
# nginx waits 60 s for headers and between a body's reads; a client of this API sends both at
# once, so half that still leaves a slow link room.
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
# Without a limit uvicorn waits for every running request, however long. Kubernetes sends its
# SIGKILL 30 s after SIGTERM by default: 20 leaves the engine's own shutdown the rest.
DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0

_HELP = {
    "model": "A GGUF file or a local HuggingFace model directory. Default: the embedded "
             f"{DEFAULT_MODEL_NAME}.",
    "dtype": "Element type the weights are stored in, and the KV cache's with "
             "--kv-cache-dtype auto: auto (float32 on the CPU, bfloat16 on CUDA), float32, "
             "bfloat16, float16. On the CPU activations and attention compute in float32 "
             "either way; bfloat16 and float16 halve the bytes a token reads (native kernel "
             "on AVX2, else widened at every matmul). On CUDA they compute in this dtype.",
    "device": "Where the model, KV cache and each step run: cpu, cuda, cuda:N, or auto (cuda "
              "when torch sees a GPU, else cpu).",
    "enforce_eager": "Never capture CUDA graphs: every decode step runs eagerly (CUDA only; "
                     "the CPU always runs eagerly).",
    "max_model_len": "Context length (prompt + output) in tokens. Default: the model's.",
    "tokenizer": "A directory with the tokenizer (tokenizer.json, tokenizer_config.json) whose "
                 "vocabulary and chat template replace the model's own; for a GGUF file, "
                 "those in its metadata. Default: the model's.",
    "seed": "Random seed for requests that do not bring their own.",
    "block_size": "Tokens per KV-cache block.",
    "kv_cache_memory_bytes": "KV-cache size: a byte count or a size such as 2GiB, 512MiB, 1.5GB. "
                             "Committed at start-up. Default: --gpu-memory-utilization of the "
                             "memory available, faulted in as blocks are first used.",
    "kv_cache_dtype": "KV-cache element type: auto (the model's dtype), float32, bfloat16, "
                      "float16. A 2-byte type holds twice the tokens in the same memory; K/V "
                      "are rounded to it once, attention still computes in float32.",
    "num_gpu_blocks_override": "Exact number of KV-cache blocks (overrides the memory "
                               "settings), committed at start-up.",
    "gpu_memory_utilization": "Share of the memory available at start-up the KV cache may use, "
                              "when no size is given.",
    "max_num_batched_tokens": "Token budget of one engine step. Default: 2048 with chunked "
                              "prefill (8192 on a GPU), else max(max_model_len, that).",
    "max_num_seqs": "Most sequences in the running batch.",
    "num_scheduler_steps": "Multi-step decoding: a step with only decodes runs the model up to "
                           "this many times, each iteration's sampled tokens fed to the next "
                           "on the device, so the scheduler and output processing run once "
                           "per N tokens. Streams then arrive N tokens at a time. Requests "
                           "with logprobs, penalties, min_tokens, bad_words, logit_bias, "
                           "allowed_token_ids or a grammar decode one token per step.",
    "enable_chunked_prefill": "Prefill long prompts over several steps, alongside decodes.",
    "enable_prefix_caching": "Reuse the KV blocks of prompt prefixes seen before.",
    "prefix_caching_hash_algo": "Prefix-cache block hash: sha256 (safe when tenants share the "
                                "server), or builtin (Python's hash: faster, single-tenant).",
    "preemption_mode": "What happens to a preempted request's KV cache: recompute it later, "
                       "or swap it to host memory.",
    "swap_space": "GiB of host memory for swapped-out KV blocks (--preemption-mode swap).",
    "scheduling_policy": "fcfs, or priority (requests' `priority` field, lower first).",
    "tensor_parallel_size": "Workers that split every layer's heads and features (tensor "
                            "parallelism).",
    "pipeline_parallel_size": "Workers that each run a contiguous stage of the layers "
                              "(pipeline parallelism).",
    "enable_lora": "Serve LoRA adapters (requests name one with lora_request / model=NAME).",
    "max_loras": "LoRA adapters in one engine step (device slots).",
    "max_lora_rank": "Largest LoRA rank accepted.",
    "max_cpu_loras": "LoRA adapters kept loaded; the least recently used are evicted. "
                     "Default: --max-loras.",
    "distributed_executor_backend": "How workers run: uni (in this process), mp (processes on "
                                    "this node), ray (a Ray cluster: RAY_ADDRESS or a local "
                                    "one). Default: uni for one worker, ray if RAY_ADDRESS is "
                                    "set, else mp.",
    "quantization": "Quantized weights: int8 (per output channel), int4 (groups of 32 with "
                    "scale and zero), gguf (a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored). "
                    "Default: float weights.",
    "structured_outputs_backend": "Library that compiles requests' structured-output grammars "
                                  "(JSON schema, regex, choice, EBNF): xgrammar.",
    "deterministic": "Bitwise-reproducible outputs: a request's token ids and logprobs do not "
                     "depend on how the engine runs it (batch size and mix, chunking, prefix "
                     "cache, preemption, threads), for a fixed block size and KV-cache dtype on "
                     "one machine and build, one worker (not tensor/pipeline parallel). Every "
                     "kernel then sums in an order set by the row alone; costs prefill time. "
                     "Needs the native kernels: float32 weights, 2-byte ones on the panel "
                     "kernel (AVX2), or int8/int4/gguf.",
    "speculative_config": "Speculative decoding, as JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}' (prompt lookup; "
                          "prompt_lookup_min/max bound the n-gram) or '{\"model\": "
                          "\"DIR_OR_GGUF\", \"num_speculative_tokens\": 4}' (a draft model "
                          "sharing the tokenizer). Greedy outputs are plain decoding's; sampled "
                          "ones keep its distribution (rejection sampling).",
}
# Fixed choices of str fields.
_CHOICES = {"preemption_mode": ["recompute", "swap"], "scheduling_policy": ["fcfs", "priority"],
            "prefix_caching_hash_algo": list(HASH_ALGOS),
            "distributed_executor_backend": list(EXECUTOR_BACKENDS),
            "dtype": ["auto", "float32", "float", "bfloat16", "float16", "half"],
            "quantization": ["int8", "int4", "gguf"],
            "runner": ["generate", "pooling"], "pooling_type": ["LAST", "MEAN"],
            "kv_cache_dtype": list(KV_CACHE_DTYPES)}
# Extra spellings, as vLLM users know them.
_ALIASES = {"kv_cache_memory_bytes": ["--kv-cache-memory"], "tensor_parallel_size": ["-tp"],
            "pipeline_parallel_size": ["-pp"]}

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '1.5GB' -> 1500000000, '4096' -> 4096."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB, 1e9)")
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_PARSERS = {"kv_cache_memory_bytes": parse_size, "pooler_config": _json_object,
            "speculative_config": _json_object}
_PARSER_METAVARS = {"pooler_config": "JSON", "speculative_config": "JSON"}


def _field_comments() -> dict[str, str]:
    """`name: type = default  # comment` lines of EngineArgs: fallback help texts."""
    try:
        source = inspect.getsource(EngineArgs)
    except (OSError, TypeError):
        return {}
    found = {}
    for m in re.finditer(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", source, re.M):
        found[m.group(1)] = m.group(2).strip()
    return found


def _unwrap(tp):
    """(base type, allows None) of an annotation such as `int | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def add_engine_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    group = parser.add_argument_group("engine", "Engine settings (vLLM's names).")
    hints = typing.get_type_hints(EngineArgs)
    comments = _field_comments()
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" and not include_model:
            continue
        if not f.init:
            continue
        base, optional = _unwrap(hints.get(f.name, str))
        flags = ["--" + f.name.replace("_", "-")] + _ALIASES.get(f.name, [])
        help_text = _HELP.get(f.name) or comments.get(f.name) or f"EngineArgs.{f.name}"
        if f.default is not dataclasses.MISSING:
            default = f.default
            if default is not None and "Default:" not in help_text:
                help_text += f" (default: {default})"
        else:
            default = argparse.SUPPRESS  # a default_factory: let EngineArgs build it
        kwargs: dict = {"dest": f.name, "default": default, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            kwargs["type"] = lambda s, e=base: e[s.upper()] if s.upper() in e.__members__ \
                else e(s)
            kwargs["metavar"] = "{" + ",".join(m.name.lower() for m in base) + "}"
        elif f.name in _PARSERS:
            kwargs["type"] = _PARSERS[f.name]
            kwargs["metavar"] = _PARSER_METAVARS.get(f.name, "SIZE")
        elif f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        elif base in (int, float, str):
            kwargs["type"] = base
            kwargs["metavar"] = {int: "N", float: "X", str: "TEXT"}[base]
        elif typing.get_origin(base) in (list, tuple):
            item = (typing.get_args(base) or (str,))[0]
            kwargs["type"] = item if item in (int, float, str) else str
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = str
        if f.name == "model":
            kwargs["metavar"] = "MODEL"
        group.add_argument(*flags, **kwargs)


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help=f"A GGUF file or a local HuggingFace model directory (or use "
                             f"--model). Default: the embedded {DEFAULT_MODEL_NAME}.")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if f.init and hasattr(ns, f.name)}
    if getattr(ns, "model_tag", None) is not None:
        if kwargs.get("model") not in (None, ns.model_tag):
            raise SystemExit(f"error: two models given: {ns.model_tag!r} and --model "
                             f"{kwargs['model']!r}")
        kwargs["model"] = ns.model_tag
    return EngineArgs(**kwargs)


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if text.lstrip().startswith("["):  # meant as JSON: a typo is not a comma list
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        value = [s.strip() for s in text.split(",") if s.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _api_key(text: str) -> str:
    # An empty key would turn the check off: an unset variable in `--api-key "$KEY"` must not.
    if not text.strip():
        raise argparse.ArgumentTypeError("the API key must not be empty (leave the flag out "
                                         "for a server without one)")
    return text


def _model_name(text: str) -> str:
    if not text.strip() or text != text.strip():  # a model "" or " x" no client can name
        raise argparse.ArgumentTypeError(f"expected a model name without surrounding "
                                         f"spaces, got {text!r}")
    return text


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:  # checked before the model loads, not at bind
        raise argparse.ArgumentTypeError(f"expected a port in 0-65535, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _lora_module(text: str):
    from pagedlm.entrypoints.openai.serving_models import parse_lora_module
    return parse_lora_module(text)


def _tool_parser_names() -> str:
    from pagedlm.entrypoints.openai.tool_parsers import TOOL_PARSERS
    return ", ".join(sorted(TOOL_PARSERS))


def _tool_call_parser(text: str) -> str:
    if text not in _tool_parser_names().split(", "):
        raise argparse.ArgumentTypeError(f"unknown tool-call parser {text!r}; the parsers are "
                                         f"{_tool_parser_names()}")
    return text


def _chat_template(text: str) -> str:
    """A file's contents, or the argument itself if it is a Jinja template; compiled now, so
    that a broken one stops the start instead of failing every chat request as a 400."""
    from pagedlm.transformers_utils.chat_template import load_chat_template
    try:
        return load_chat_template(text, "--chat-template")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="Address to listen on; 0.0.0.0 for every interface. (default: "
                            "127.0.0.1)")
    group.add_argument("--port", type=_port, default=8000, metavar="N",
                       help="Port to listen on; 0 picks a free one (logged). (default: 8000)")
    group.add_argument("--api-key", type=_api_key, default=envs.PAGEDLM_API_KEY, metavar="KEY",
                       help="Require `Authorization: Bearer KEY` on every route but /health "
                            "and the web page (default: $PAGEDLM_API_KEY, else no key).")
    group.add_argument("--max-request-body-bytes", type=parse_size,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="SIZE",
                       help="Largest request body accepted; a larger one is a 413 before it is "
                            "read, e.g. 64MiB. (default: 32MiB)")
    group.add_argument("--max-request-body-values", type=int,
                       default=DEFAULT_MAX_REQUEST_BODY_VALUES, metavar="N",
                       help="Most JSON values (token ids, strings, ...; counted by their commas) "
                            "a request body may hold; more is a 413 before it is parsed. "
                            f"(default: {DEFAULT_MAX_REQUEST_BODY_VALUES})")
    group.add_argument("--served-model-name", nargs="+", type=_model_name, default=None,
                       metavar="NAME",
                       help="Model name(s) the API answers to; the first one is reported. "
                            "Default: MODEL as given, or " + DEFAULT_MODEL_NAME + ".")
    group.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                       help='CORS: allowed origins, a JSON list. (default: ["*"])')
    group.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                       help='CORS: allowed methods, a JSON list. (default: ["*"])')
    group.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                       help='CORS: allowed headers, a JSON list. (default: ["*"])')
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials.")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (its access log is at info). (default: info)")
    group.add_argument("--timeout-keep-alive", type=_positive_seconds, default=5,
                       metavar="SECONDS",
                       help="Seconds an idle HTTP keep-alive connection stays open. "
                            "(default: 5)")
    group.add_argument("--request-read-timeout", type=_positive_seconds,
                       default=DEFAULT_REQUEST_READ_TIMEOUT_S, metavar="SECONDS",
                       help="A connection is closed unless a request's headers arrive within "
                            "SECONDS of connecting (or of the previous response), and a "
                            "request whose body pauses for longer than SECONDS is a 408, and a "
                            "connection whose client reads nothing of its answer for SECONDS "
                            "is cut (the request aborted): slow clients cannot hold the "
                            "server's sockets. (default: "
                            f"{DEFAULT_REQUEST_READ_TIMEOUT_S:g})")
    group.add_argument("--timeout-graceful-shutdown", type=_positive_seconds,
                       default=DEFAULT_GRACEFUL_SHUTDOWN_S, metavar="SECONDS",
                       help="On SIGTERM, SIGINT or SIGHUP (a closed terminal; under nohup it "
                            "stays ignored), requests still running after SECONDS are "
                            "cancelled (aborted in the engine) and the server exits: a long "
                            "stream, or a client that stopped reading, cannot hold the "
                            "shutdown. (default: "
                            f"{DEFAULT_GRACEFUL_SHUTDOWN_S:g})")
    group.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters to serve (with --enable-lora), each as name=path "
                            "or JSON {\"name\", \"path\", \"base_model_name\"}; a request "
                            "selects one with model=NAME.")
    group.add_argument("--enable-runtime-lora-updating", action="store_true",
                       help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")
    group.add_argument("--chat-template", type=_chat_template, default=None,
                       metavar="FILE|TEMPLATE",
                       help="A Jinja chat template (a file, or the template itself) replacing "
                            "the tokenizer's, e.g. examples/tool_chat_template_hermes_chatml"
                            ".jinja for tool calling with ChatML models.")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="Render a chat_template sent with a request (chat completions, "
                            "/tokenize). A template is code the server runs: without this flag "
                            "such a request is a 400.")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='Allow tool_choice "auto": the model decides to call tools, and '
                            "--tool-call-parser reads the calls from its output.")
    group.add_argument("--tool-call-parser", type=_tool_call_parser, default=None,
                       metavar="NAME",
                       help="How the model writes tool calls: " + _tool_parser_names() + ".")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="Do not log the periodic engine stats line.")
    group.add_argument("--log-stats-interval", type=_positive_seconds, default=5.0,
                       metavar="SECONDS",
                       help="Seconds between engine stats lines. (default: 5)")
