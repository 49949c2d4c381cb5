"""Fuzz the OpenAI server against its own OpenAPI document with schemathesis.

Starts the server itself (the default model unless --model; a generating server, and with
--runner both also a pooling one), then for every operation in /openapi.json generates
--max-examples requests from the document's request schemas (positive data, and with
--negative also schema-violating data) and checks each response: no 5xx, a status code the
document lists, a content type it lists, and a body that conforms to the documented schema.
max_tokens (and max_completion_tokens) are clamped to --max-tokens so generation stays short.

    python scripts/fuzz_openapi.py --max-examples 100
Prints per operation: requests sent, the status codes seen, and the failures (first few). Exit
status 1 if anything failed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK_NAMES = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance")
# Bodies fields whose size decides how long a request runs.
CLAMPED_FIELDS = ("max_tokens", "max_completion_tokens")


def clamp_body(body, max_tokens: int):
    """Keep generation short: clamp the token limits (and set one where the default would be
    the whole context, as in chat)."""
    if not isinstance(body, dict):
        return body
    for name in CLAMPED_FIELDS:
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > max_tokens:
            body[name] = max_tokens
    if "messages" in body or "prompt" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = max_tokens
    return body


@contextlib.contextmanager
def serve(engine, **app_kwargs):
    """The real app under uvicorn on a free local port, in a thread."""
    import uvicorn
    from pagedlm.entrypoints.openai.api_server import build_app
    app = build_app(engine, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class OperationReport:
    def __init__(self, label: str) -> None:
        self.label = label
        self.statuses: collections.Counter[int] = collections.Counter()
        self.failures: list[str] = []

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())


def fuzz_operation(operation, base_url: str, max_examples: int, max_tokens: int, mode: str,
                   seed: int, headers: dict | None = None,
                   deadline_s: float | None = None) -> OperationReport:
    """Send max_examples generated requests to one operation; every response is checked.
    deadline_s: a request that takes longer (a hang, a stalled server) is a failure."""
    import datetime

    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import CHECKS
    from schemathesis.generation import GenerationMode
    from hypothesis import seed as hyp_seed
    from hypothesis.errors import DeadlineExceeded, Flaky, Unsatisfiable

    checks = [CHECKS.get_by_names([name])[0] for name in CHECK_NAMES]
    report = OperationReport(operation.label)
    session = requests.Session()

    @hyp_seed(seed)
    @settings(max_examples=max_examples, database=None,
              deadline=None if deadline_s is None else datetime.timedelta(seconds=deadline_s),
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case) -> None:
        if case.body is not None:
            case.body = clamp_body(case.body, max_tokens)
        try:
            response = case.call(base_url=base_url, session=session, headers=headers,
                                 timeout=120)
        except Exception as e:  # noqa: BLE001 - a dropped connection is a failure too
            report.failures.append(f"request failed: {e!r}; body={case.body!r:.300}")
            return
        report.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=checks)
        except BaseException as e:  # noqa: BLE001 - Failure or FailureGroup: recorded
            if isinstance(e, KeyboardInterrupt):
                raise
            report.failures.append(f"{response.status_code} {str(e).strip()[:600]}\n"
                                   f"    body={case.body!r:.300}")

    try:
        run()
    except Unsatisfiable:  # negative mode on an operation without inputs: nothing to break
        pass
    except (DeadlineExceeded, Flaky) as e:  # Flaky: slow once, then not when replayed
        report.failures.append(f"a request took over {deadline_s}s: {str(e).strip()[:600]}")
    session.close()
    return report


def fuzz_server(base_url: str, max_examples: int, max_tokens: int, modes: list[str],
                seed: int = 0, only: set[str] | None = None, headers: dict | None = None,
                verbose: bool = True, deadline_s: float | None = None
                ) -> list[OperationReport]:
    """Fuzz every operation of the server's document (or those whose path is in `only`)."""
    import schemathesis
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers)
    reports = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if only and operation.path not in only:
            continue
        for mode in modes:
            t = time.perf_counter()
            r = fuzz_operation(operation, base_url, max_examples, max_tokens, mode, seed,
                               headers, deadline_s)
            r.label = f"{operation.label} [{mode}]"
            reports.append(r)
            if not verbose:
                continue
            print(f"  {r.label}: {r.sent} requests in {time.perf_counter() - t:.1f}s, status "
                  f"{dict(sorted(r.statuses.items()))}, {len(r.failures)} failures", flush=True)
            for f in r.failures[:5]:
                print("    FAIL", f, flush=True)
    return reports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-examples", type=int, default=100, help="per operation and mode")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--negative", action="store_true",
                    help="also send schema-violating requests (they must get a 4xx)")
    ap.add_argument("--runner", choices=["generate", "pooling", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.engine.async_llm_engine import AsyncLLMEngine

    modes = ["positive"] + (["negative"] if args.negative else [])
    runners = ["generate", "pooling"] if args.runner == "both" else [args.runner]
    reports = []
    t0 = time.perf_counter()
    for runner in runners:
        # Small limits: an oversized n or prompt is a quick 400, not minutes of decoding.
        engine = AsyncLLMEngine.from_engine_args(
            EngineArgs(model=args.model, runner=runner, max_model_len=512, max_num_seqs=8),
            log_stats=False)
        try:
            with serve(engine, enable_runtime_lora_updating=True) as url:
                print(f"{runner} server at {url}", flush=True)
                # The pooling server's generation routes only answer 400: fuzzed lightly.
                reports += fuzz_server(url, args.max_examples, args.max_tokens, modes,
                                       args.seed)
            if not engine.is_running:
                print(f"ENGINE DIED: {engine.dead_error!r}")
                return 1
        finally:
            engine.shutdown()
    failed = sum(len(r.failures) for r in reports)
    sent = sum(r.sent for r in reports)
    print(f"{len(reports)} operation runs, {sent} requests, {failed} failures, "
          f"{time.perf_counter() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
