"""`pagedlm serve`'s first steps, taken before the HTTP stack is imported: check the flags, bind
the socket and start building the engine on its thread. The imports of FastAPI, uvicorn and the
serving modules (about 0.5 s here) then run while the model loads; api_server.run_server waits
for the engine before it serves."""
from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from pagedlm import prefault
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine


@dataclass
class ServerStart:
    """What start_server began: the engine is still building (AsyncLLMEngine(wait=False))."""
    engine_args: EngineArgs
    served_model_names: list[str]
    sock: socket.socket
    engine: AsyncLLMEngine

    def close(self) -> None:
        """Give up before serving: stop the engine (once built) and free the port."""
        try:
            self.engine.shutdown()
        finally:
            self.sock.close()


def start_server(args: argparse.Namespace,
                 memory: prefault.PrefaultedMemory | None = None) -> ServerStart:
    """`memory`: what cli._prefault faulted in for the model's panels; the engine's build
    carves them from it and finishes it, whatever happens."""
    from pagedlm.entrypoints.cli_args import engine_args_from_namespace

    engine_args = engine_args_from_namespace(args)
    if args.lora_modules and not engine_args.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser")
    names = args.served_model_name or [default_served_name(engine_args.model)]
    sock = bind(args.host, args.port)  # before the model loads: a taken port fails at once
    try:
        build = prefault.loading_into(memory, lambda: LLMEngine.from_engine_args(engine_args))
        engine = AsyncLLMEngine(build, log_stats=not args.disable_log_stats,
                                log_stats_interval=args.log_stats_interval,
                                model_name=names[0], wait=False)
    except BaseException:
        sock.close()
        raise
    return ServerStart(engine_args, names, sock, engine)


def default_served_name(model: str | None) -> str:
    from pagedlm.entrypoints.cli_args import DEFAULT_MODEL_NAME
    return model if model is not None else DEFAULT_MODEL_NAME


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
