"""The `pagedlm` command: serve an OpenAI-compatible API, or generate / chat in the terminal.

    pagedlm serve [MODEL] [--port 8000] [--api-key KEY] [engine flags]
    pagedlm generate [MODEL] --prompt "Once upon a time" [--max-tokens 64]
    pagedlm chat [MODEL] [--system "You are terse."]

MODEL is a GGUF file or a local HuggingFace model directory; without one, the embedded
SmolLM2-135M-Instruct runs. `pagedlm CMD --help` lists every flag.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import textwrap

import pagedlm
from pagedlm import envs, panel_cache, prefault

logger = logging.getLogger("pagedlm.cli")

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging(level: str) -> None:
    """Logging is set up here, by the command, never on import."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%m-%d %H:%M:%S",
                        stream=sys.stderr)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens,
                   help=f"Most tokens to generate. (default: {default_max_tokens})")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="0 for greedy decoding. (default: 0.7)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0: disabled. (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="(default: 0.0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: 1.0)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="Stop string (repeatable).")


def _add_lora_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", default=None, metavar="PATH",
                        help="A PEFT LoRA adapter directory to generate with (turns on "
                             "--enable-lora, and raises --max-lora-rank to its rank).")


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default,
                        choices=["debug", "info", "warning", "error"],
                        help=f"pagedlm's log level (to stderr). (default: {default})")


def make_parser() -> argparse.ArgumentParser:
    # Imported here, not with this module: cli_args imports torch and transformers (about
    # 1.7 s), which `main` overlaps with faulting memory in (_prefault).
    from pagedlm.entrypoints.cli_args import (add_engine_args, add_model_positional,
                                              add_server_args)

    parser = argparse.ArgumentParser(
        prog="pagedlm", formatter_class=_Formatter,
        description="pagedlm: a small LLM inference engine with a paged KV cache and "
                    "continuous batching.",
        epilog=textwrap.dedent("""\
            examples:
              pagedlm serve                          # OpenAI-compatible API on 127.0.0.1:8000
              pagedlm serve model.gguf --port 9000 --api-key secret
              pagedlm generate --prompt "The capital of France is" --temperature 0
              pagedlm chat

            Run `pagedlm COMMAND --help` for a command's flags."""))
    parser.add_argument("--version", action="version", version=f"pagedlm {pagedlm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", formatter_class=_Formatter, help="Serve an OpenAI-compatible HTTP API.",
        description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/completions, "
                    "/v1/chat/completions, /v1/models, plus /health and /metrics "
                    "(Prometheus).")
    add_model_positional(serve)
    add_server_args(serve)
    add_engine_args(serve)
    _add_log_level(serve, "info")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", formatter_class=_Formatter,
                         help="Complete a prompt, streaming the text to stdout.",
                         description="Complete a prompt (plain text, no chat template), "
                                     "streaming the text to stdout as it is generated.")
    add_model_positional(gen)
    gen.add_argument("--prompt", "-p", default=None,
                     help="The prompt. Default: read it from stdin.")
    _add_lora_arg(gen)
    _add_sampling_args(gen, 128)
    add_engine_args(gen)
    _add_log_level(gen, "warning")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat", formatter_class=_Formatter, help="Chat in the terminal (streaming, with history).",
        description="Chat with MODEL through its chat template. Each line you type is a user "
                    "message; the reply streams back and the conversation is kept. Works with "
                    "piped input too (one message per line). /clear forgets the history; "
                    "/exit, Ctrl-D or end of input quits.")
    add_model_positional(chat)
    chat.add_argument("--system", default=None, help="A system message to start with.")
    _add_lora_arg(chat)
    _add_sampling_args(chat, 512)
    add_engine_args(chat)
    _add_log_level(chat, "warning")
    chat.set_defaults(func=cmd_chat)

    trace = sub.add_parser(
        "trace", formatter_class=_Formatter, help="Render a step trace (--trace-file) as HTML "
                                                   "and PNG.",
        description="Render a step trace written by --trace-file: DIR/trace.html (a "
                    "self-contained timeline: requests x steps, prefill and decode, "
                    "preemptions; the KV block map over time), DIR/timeline.png and "
                    "DIR/kv_blocks.png. Needs matplotlib.")
    trace.add_argument("file", metavar="FILE",
                       help="The trace JSON (its .steps.jsonl beside it is read) or the "
                            ".steps.jsonl itself.")
    trace.add_argument("-o", "--output-dir", default="trace", metavar="DIR",
                       help="Where to write the files.")
    _add_log_level(trace, "warning")
    trace.set_defaults(func=cmd_trace)
    return parser


def cmd_trace(args: argparse.Namespace) -> None:
    from pagedlm.metrics.trace_render import render
    for path in render(args.file, args.output_dir):
        print(path)


def cmd_serve(args: argparse.Namespace,
              memory: prefault.PrefaultedMemory | None = None) -> None:
    from pagedlm.entrypoints.openai.server_start import start_server
    try:
        # the model loads on the engine's thread from here on
        start = start_server(args, memory=memory)
    except BaseException:
        if memory is not None:
            memory.finish()
        raise
    try:
        from pagedlm.entrypoints.openai.api_server import run_server
    except BaseException:
        start.close()
        raise
    run_server(args, start)


def _sampling_params(args: argparse.Namespace):
    from pagedlm.sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, stop=args.stop,
                          output_kind=RequestOutputKind.DELTA)


def _stream(engine, request_id: str, prompt, params, out, lora_request=None) -> str:
    """Run one request on a synchronous LLMEngine, writing its text as it comes."""
    engine.add_request(request_id, prompt, params, lora_request=lora_request)
    text = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.outputs:
                    delta = output.outputs[0].text
                    text.append(delta)
                    out.write(delta)
                    out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        out.write(" [interrupted]")
    return "".join(text)


def _build_engine(args: argparse.Namespace):
    """The engine and the --lora adapter's request (None without one)."""
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.entrypoints.cli_args import engine_args_from_namespace
    from pagedlm.lora.request import LoRARequest

    engine_args = engine_args_from_namespace(args)
    lora = None
    if getattr(args, "lora", None):
        engine_args.enable_lora = True
        rank = _adapter_rank(args.lora)
        if rank is not None:
            engine_args.max_lora_rank = max(engine_args.max_lora_rank, rank)
        lora = LoRARequest(os.path.basename(os.path.normpath(args.lora)) or "lora", 1,
                           args.lora)
    engine = LLMEngine.from_engine_args(engine_args)
    if lora is not None:
        engine.add_lora(lora)  # a bad adapter fails now, with its message
    return engine, lora


def _adapter_rank(path: str) -> int | None:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            rank = json.load(f).get("r")
    except (OSError, ValueError):
        return None  # the engine's loader reports what is wrong
    return rank if isinstance(rank, int) else None


def cmd_generate(args: argparse.Namespace) -> None:
    if args.prompt is None and sys.stdin.isatty():
        print("Reading the prompt from stdin; end it with Ctrl-D.", file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise SystemExit("error: empty prompt (give --prompt or pipe one in)")
    params = _sampling_params(args)
    engine, lora = _build_engine(args)
    try:
        _stream(engine, "generate-0", prompt, params, sys.stdout, lora)
        sys.stdout.write("\n")
    finally:
        engine.shutdown()  # writes --trace-file


def cmd_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    engine, lora = _build_engine(args)
    try:
        _chat_loop(args, params, engine, lora)
    finally:
        engine.shutdown()  # writes --trace-file


def _chat_loop(args: argparse.Namespace, params, engine, lora) -> None:
    from pagedlm.entrypoints.openai.serving_chat import apply_chat_template

    tokenizer = engine.get_tokenizer()
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with pagedlm. /clear forgets the history, /exit or Ctrl-D quits.",
              file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not interactive and line == "":
            break  # end of piped input
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/clear":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        prompt = apply_chat_template(tokenizer, history)
        try:
            reply = _stream(engine, f"chat-{turn}", prompt, params, sys.stdout, lora)
        except ValueError as e:  # e.g. the conversation outgrew the context: drop the turn
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        turn += 1
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})


# --dtype values that keep a checkpoint's matrices in 2 bytes (config.py's _DTYPES).
_TWO_BYTE_DTYPES = ("bfloat16", "float16", "half")
# Below this, faulting the panels in ahead is not worth a thread.
_PREFAULT_MIN_BYTES = 64 << 20


def _flag_values(argv: list[str], flags: tuple[str, ...]) -> dict[str, str]:
    """The last value given to each of `flags` in argv, as `--flag VALUE` or `--flag=VALUE`."""
    values = {}
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg.startswith(flag + "="):
                values[flag] = arg[len(flag) + 1:]
            elif arg == flag and i + 1 < len(argv):
                values[flag] = argv[i + 1]
    return values


def _prefault(argv: list[str], min_bytes: int = _PREFAULT_MIN_BYTES,
              ) -> prefault.PrefaultedMemory | None:
    """For `pagedlm serve DIR --dtype bfloat16` (or float16) on this process's CPU: the
    panels' memory, being faulted in while the parser's imports run (prefault.py). Read from
    argv before any parser exists, so only the plainest spellings count (the model as the
    first argument after `serve` or --model); a flag that could put the weights elsewhere
    (other processes, a GPU, a quantized format) rules it out, and so does a panels' file
    that an earlier load left in the cache (panel_cache.py). Any spelling missed only
    forgoes the head start: the parser still checks everything."""
    if len(argv) < 2 or argv[0] != "serve" or envs.PAGEDLM_DISABLE_HUGE_PAGES:
        return None
    values = _flag_values(argv[1:], ("--model", "--dtype", "--device", "--quantization",
                                     "--tensor-parallel-size", "-tp",
                                     "--pipeline-parallel-size", "-pp"))
    model = values.get("--model", None if argv[1].startswith("-") else argv[1])
    if (model is None or values.get("--dtype") not in _TWO_BYTE_DTYPES
            or values.get("--device", "cpu") != "cpu" or "--quantization" in values
            or any(values.get(f, "1") != "1" for f in ("--tensor-parallel-size", "-tp",
                                                       "--pipeline-parallel-size", "-pp"))
            or not os.path.isdir(model)):
        return None
    dtype = "float16" if values["--dtype"] == "half" else values["--dtype"]
    if panel_cache.is_cached(model, dtype):
        return None  # the panels are mapped from their file: no fresh memory to fault in
    return prefault.for_checkpoint(model, min_bytes)


def main(argv: list[str] | None = None) -> None:
    # The cyclic garbage collector stays off while the command imports and builds: during
    # `pagedlm serve`'s start it made four full passes over torch's and transformers' objects,
    # 0.22 s of the 1B Q4_K_M file's 2.4 s to ready (Zen 4 EPYC), to find 1.1 MB of garbage.
    # serve turns it back on once it is built (api_server.run_server), any other command
    # once its arguments are parsed.
    gc.disable()
    try:
        _main(sys.argv[1:] if argv is None else list(argv))
    finally:
        gc.enable()


def _main(argv: list[str]) -> None:
    memory = _prefault(argv)
    try:
        args = make_parser().parse_args(argv)
    except BaseException:
        if memory is not None:
            memory.finish()
        raise
    if memory is not None and args.func is not cmd_serve:
        memory.finish()
    if args.func is not cmd_serve:
        gc.enable()
    configure_logging(args.log_level)
    try:
        if args.func is cmd_serve:
            cmd_serve(args, memory)
        else:
            args.func(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # the shell's code for SIGINT: a start cut short failed
    except ValueError as e:  # bad engine settings and the like: a message, not a traceback
        logger.debug("error", exc_info=True)
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
