"""CUDA graphs on a GPU (worker/cuda_graph.py): decode steps replayed from the captured graphs,
padded to a capture size, give the tokens and logprobs of the same engine with
enforce_eager=True; the graphs are really replayed. The sizes, padding and eligibility logic
are tested on the CPU in tests/engine/test_cuda_graph_logic.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pagedlm import LLM, SamplingParams  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

# Five prompts of different lengths and output lengths: the decode batch shrinks 5 -> 4 -> 3
# -> 2 -> 1 as they finish, so steps run padded (5 on the graph of 8, 3 on 4) and re-pad the
# rows a larger step left.
PROMPTS = ["The capital of France is", "One, two, three,", "Hello",
           "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
           "def fibonacci(n):"]
MAX_TOKENS = [24, 20, 16, 12, 8]


@pytest.fixture(autouse=True)
def _no_tf32():
    """Float32 on the GPU computes in float32 (TF32 would round the matmuls' inputs)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("graphs"), "llama", default_model_dir)


def _generate(path: str, enforce_eager: bool, **kwargs):
    """(outputs, the worker's graph runner or None, its replay count)."""
    params = [SamplingParams(max_tokens=m, temperature=0, logprobs=1, ignore_eos=True)
              for m in MAX_TOKENS]
    # A small explicit KV cache, so the two engines of a test fit beside each other whatever
    # the GPU's memory.
    with LLM(path, device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=8,
             max_model_len=256, num_gpu_blocks_override=128, **kwargs) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        graphs = llm.llm_engine.executor.worker.runner.cuda_graphs
        replays = graphs.replays if graphs is not None else 0
        sizes = graphs.sizes if graphs is not None else None
    torch.cuda.empty_cache()
    return outs, sizes, replays


def _assert_same(graphed, eager):
    for g, e in zip(graphed, eager):
        g, e = g.outputs[0], e.outputs[0]
        assert g.token_ids == e.token_ids
        for lp_g, lp_e, tok in zip(g.logprobs, e.logprobs, g.token_ids):
            assert abs(lp_g[tok].logprob - lp_e[tok].logprob) < 1e-3


def test_graphs_give_the_eager_tokens_and_are_replayed(tiny_llama):
    eager, eager_sizes, _ = _generate(tiny_llama, enforce_eager=True)
    graphed, sizes, replays = _generate(tiny_llama, enforce_eager=False)
    assert eager_sizes is None  # enforce_eager captures nothing
    assert sizes == [1, 2, 4, 8]
    # Every step after the prefills is pure decode: one replay per token past the first
    # (the first token comes from the prefill step), give or take steps that mix in a prefill.
    assert replays >= max(MAX_TOKENS) - 2, replays
    assert [len(o.outputs[0].token_ids) for o in graphed] == MAX_TOKENS
    _assert_same(graphed, eager)


def test_speculative_verification_rows_replay_too(tiny_llama):
    """n-gram drafts make a sequence 1 + k decode rows: still a pure decode step."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    eager, _, _ = _generate(tiny_llama, enforce_eager=True, speculative_config=spec)
    graphed, sizes, replays = _generate(tiny_llama, enforce_eager=False,
                                        speculative_config=spec)
    assert sizes == [1, 2, 4, 8] and replays > 0
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


def test_multi_step_replays_a_graph_per_iteration(tiny_llama):
    """num_scheduler_steps=4: a step of decodes replays its graph once per iteration, the ids
    passing between iterations on the device; the tokens are single steps' (eager here), and
    greedy rows next to a seeded sampled one stay put."""
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.9, seed=3,
                               ignore_eos=True)
    results = {}
    for steps, eager in ((1, True), (4, False)):
        with LLM(tiny_llama, device="cuda", dtype="float32", enforce_eager=eager,
                 max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=128,
                 num_scheduler_steps=steps) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            engine = llm.llm_engine
            graphs = engine.executor.worker.runner.cuda_graphs
            results[steps] = ([o.outputs[0].token_ids for o in outs], engine.stats.num_steps,
                              graphs.replays if graphs is not None else 0)
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        torch.cuda.empty_cache()
    (single, single_steps, _), (multi, multi_steps, replays) = results[1], results[4]
    assert [len(t) for t in multi] == MAX_TOKENS
    assert multi == single
    assert multi_steps < single_steps / 2 and replays >= max(MAX_TOKENS) - 2
