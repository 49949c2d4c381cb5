"""The benchmark library behind benchmarks/throughput.py, serving.py and compare.py.

- workload: request shapes, random ordinary-token prompts, Poisson arrival times;
- stats: percentiles, medians with their range, throughput figures, machine facts;
- client: the OpenAI-compatible HTTP client (streamed and not) and its count checks;
- servers: how each system's server is launched for a workload, and stopped;
- capacity: the highest request rate a server sustains within a latency SLO (bisection);
- op_times: where an in-process engine's time goes, through its step-observer hook and the
  model's module hooks;
- legs: running a benchmark script in a fresh process, at this tree or at another commit;
- peers: setting up vLLM's CPU build and llama.cpp once.

The scripts import it as `lib`: Python puts a script's own folder first on sys.path, so
`python benchmarks/throughput.py` finds it with no path manipulation. pagedlm itself must be
importable (scripts/setup.sh installs it in editable mode).
"""
