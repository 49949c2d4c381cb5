"""quantization= through the engine: the embedded GGUF run on its own Q4_1/Q8_0 blocks against
the float32 path, int8/int4 agreement and perplexity next to float32's, any model built on the
parallel layers (tiny Llama and Qwen2 with biases), and the errors for bad settings."""
from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.kernels.loader import available
from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
from pagedlm.model_executor.layers.quantization import QUANTIZATION_METHODS, kernels
from pagedlm.model_executor.layers.quantization.base import weight_formats
from pagedlm.model_executor.layers.quantization.gguf import GGUFConfig
from pagedlm.model_executor.model_loader.model_path import CONVERSION_MARKER
from tests.conftest import make_tiny_model

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "List three fruits that are red:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
]
# Written for this test: ordinary English prose for perplexity.
TEXT = (
    "The town library opened its doors at nine every morning, and by ten the reading room was "
    "usually full. Students came to prepare for their examinations, retired teachers came to "
    "read the newspapers, and small children sat on the carpet in the corner while a volunteer "
    "read stories aloud. The building itself was old: its wooden floors creaked, the windows "
    "were tall and narrow, and in winter the radiators made a gentle knocking sound. Last year "
    "the council decided to repair the roof and to replace the heating system."
)
MAX_TOKENS = 32


def _model(llm: LLM):
    return llm.llm_engine.executor.worker.model


def _greedy(llm: LLM, prompts: list[str], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _perplexity(llm: LLM, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = [pos[t].logprob for t, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


def _top2(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[dict[int, float]]]:
    """Each greedy position's two most likely tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


@pytest.fixture(scope="module")
def default_runs():
    """Each weight format of the default model, loaded one at a time (the models are freed in
    between): its greedy outputs, its perplexity on TEXT and its layers' weight formats."""
    runs = {}
    for q in (None, "gguf", "int8", "int4"):
        llm = LLM(quantization=q)
        runs[q] = {"greedy": _greedy(llm, PROMPTS, MAX_TOKENS), "ppl": _perplexity(llm, TEXT),
                   "formats": weight_formats(_model(llm)), "top2": _top2(llm, PROMPTS, MAX_TOKENS)}
        del llm
        gc.collect()
    return runs


def test_gguf_runs_the_files_blocks_and_matches_float32(default_runs):
    """The float32 run has the same weights (the file's blocks dequantized), but the q4_1 and
    q8_0 kernels take their input at 8 bits per 32-block, as llama.cpp's do, so float32 is no
    longer the same math up to the summation order. Nor is any engine-level run that quantizes
    the activations the same way in PyTorch: a rounding that a last-bit difference flips moves
    the next layer's input by a whole 8-bit step, and that spreads (such a run agreed with the
    kernels' no better than float32 does). The kernels are checked against that reference layer
    by layer (tests/kernels/test_quant_dot.py); here the model must keep float32's quality:
    perplexity within 0.5% (issue 32), logprobs close where the tokens agree, and every prompt's
    first difference at a near-tie of both runs.

    How far the tokens agree is a draw too: 3/8 prompts identical and 148/256 tokens before the
    first difference on the AVX2 EPYC, 2/8 and 100/256 on the Zen 4 EPYC (AVX-512 VNNI, no
    AMX), where a first difference's two tokens moved 0.03-0.32 against each other (the two
    runs' margins added). So the bound is on that move, not on a count: 0.6, twice the 0.3 that
    one token's logprob may move where the tokens agree.

    On TEXT's ~100 tokens that perplexity is a draw, not a fixed figure: the same 8-bit math in
    other float orders gave x1.0022 (transformers), x1.0101 (a PyTorch emulation) and x1.0237
    (the kernels on the AMX Xeon, every layer within 6e-7 of the kernels' reference), and
    scaling every quantized layer's input by 1 + 1e-7 randn gave x0.989 to x1.017 over 40
    seeds. So the bound here is 3%, which only a real fault crosses; issue 32's 0.5% is checked
    on benchmarks/quality.py's longer text."""
    # Every linear layer on the file's own blocks: the Q4_1 layers and the Q8_0 tied head.
    formats = default_runs["gguf"]["formats"]
    assert "float" not in formats and set(formats) == {"q4_1", "q8_0"}, formats
    ref, run = default_runs[None], default_runs["gguf"]
    tokens, diffs, moves = [], [], []
    for (rt, rl), (gt, gl), rtop, gtop in zip(ref["greedy"], run["greedy"], ref["top2"],
                                              run["top2"]):
        n = _first_difference(rt, gt)
        tokens.append(n)
        diffs += np.abs(np.array(rl[:n]) - np.array(gl[:n])).tolist()
        if n < MAX_TOKENS:
            # Same prefix, so both runs rank the same two tokens at n: each run's choice must be
            # the other's second, and the pair's margins small.
            a, b = rt[n], gt[n]
            assert b in rtop[n] and a in gtop[n], (n, rtop[n], gtop[n])
            moves.append(rtop[n][a] - rtop[n][b] + gtop[n][b] - gtop[n][a])
    ratio = run["ppl"] / ref["ppl"]
    print(f"gguf: perplexity {run['ppl']:.4f} vs float32 {ref['ppl']:.4f} (x{ratio:.4f}); "
          f"prompts identical {sum(n == MAX_TOKENS for n in tokens)}/8, tokens before the first "
          f"difference {sum(tokens)}/{8 * MAX_TOKENS}; logprob differences max "
          f"{max(diffs):.4f}, mean {np.mean(diffs):.4f}; tokens {tokens}; the first "
          f"differences' moves {[round(m, 3) for m in moves]}")
    assert abs(ratio - 1) < 0.03
    assert max(diffs) < 0.3 and np.mean(diffs) < 0.05
    assert all(m < 0.6 for m in moves), moves


@pytest.mark.parametrize("quantization,bound", [("int8", 1.05), ("int4", 1.15)])
def test_int8_int4_perplexity_and_agreement(default_runs, quantization, bound):
    ref, run = default_runs[None], default_runs[quantization]
    formats = run["formats"]
    assert "float" not in formats, formats
    ratio = run["ppl"] / ref["ppl"]
    tokens = [_first_difference(r[0], g[0]) for r, g in zip(ref["greedy"], run["greedy"])]
    print(f"{quantization}: perplexity {run['ppl']:.3f} vs float32 {ref['ppl']:.3f} "
          f"(x{ratio:.3f}); prompts identical {sum(n == MAX_TOKENS for n in tokens)}/8, "
          f"tokens before the first difference {sum(tokens)}/{8 * MAX_TOKENS}")
    assert ratio < bound
    # The first token of most prompts: quantization that broke the model would miss them.
    assert sum(n > 0 for n in tokens) >= 6


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("quant")
    return {"llama": make_tiny_model(root, "llama", default_model_dir),
            "qwen2": make_tiny_model(root, "qwen2", default_model_dir)}


def _dequantized_twin(src: str, dst: str, quantization: str) -> str:
    """A float copy of the HF model at `src` whose linear weights are what `quantization`
    packs them to, dequantized by the formats' plain-PyTorch reference: pagedlm on `src`
    quantized and on this copy in float run the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.data
            if quantization == "int4" and name != "lm_head":  # the head stays int8 (see int4)
                deq = kernels.dequantize_reference("q4_1", kernels.quantize_q4_1(w))
            else:
                deq = kernels.dequantize_reference("i8", *kernels.quantize_i8(w))
            w.copy_(deq)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def _vocab(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def _assert_same(ref, got, atol: float) -> None:
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(ref, got):
        assert np.abs(np.array(a) - np.array(b)).max() < atol


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_any_model_on_the_parallel_layers(tiny_models, tmp_path, monkeypatch, arch,
                                         quantization):
    """No model code: Qwen2's biased qkv_proj quantizes like Llama's, and the quantized engine
    equals the float engine on the same (dequantized) weights. int4's q4_1 kernel takes its
    input at 8 bits per 32-block, so for int4 the float engine's linear layers (but the head,
    int8 on float input there) quantize theirs the same way, each through the Python layer
    path (the fused decode stack off). Where the kernels are off, int4 dequantizes its weights
    and takes x in float32, as int8 does."""
    eight_bit_x = quantization == "int4" and available()
    twin = _dequantized_twin(tiny_models[arch], str(tmp_path / "twin"), quantization)
    with monkeypatch.context() as patch:
        if eight_bit_x:
            patch.setenv("PAGEDLM_DISABLE_FUSED_DECODE", "1")
            float_apply = UnquantizedLinearMethod.apply

            def apply(self, layer, x, bias=None):
                if layer.weight.shape[0] == _vocab(twin):  # the LM head
                    return float_apply(self, layer, x, bias)
                q, d, _ = kernels.quantize_activations_reference(x.reshape(-1, x.shape[-1]))
                xq = (q.float().reshape(q.shape[0], -1, 32) * d[..., None]).reshape(x.shape)
                return float_apply(self, layer, xq, bias)

            patch.setattr(UnquantizedLinearMethod, "apply", apply)
        ref = _greedy(LLM(model=twin), PROMPTS[:4], 8)
    llm = LLM(model=tiny_models[arch], quantization=quantization)
    assert "float" not in weight_formats(_model(llm))
    got = _greedy(llm, PROMPTS[:4], 8)
    if not eight_bit_x:
        _assert_same(ref, got, atol=1e-3)
        return
    # A last-bit difference between the two float sums can still flip one activation's 8-bit
    # rounding, which moves that input by a whole step (seen once in 32 logprobs: 8.4e-3, the
    # rest within 4e-6): at most one such logprob per prompt.
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(ref, got):
        err = np.abs(np.array(a) - np.array(b))
        assert (err >= 1e-3).sum() <= 1 and err.max() < 2e-2, err


def test_bad_quantization_raises_value_error(tiny_models):
    with pytest.raises(ValueError, match=r"quantization must be one of \['gguf', 'int4', "
                                         r"'int8'\].*'int3'"):
        LLM(model=tiny_models["llama"], quantization="int3")
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF model file"):
        EngineArgs(model=tiny_models["llama"], quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="cannot be combined with enable_lora"):
        EngineArgs(model=tiny_models["llama"], quantization="int8",
                   enable_lora=True).create_engine_config()
    assert set(QUANTIZATION_METHODS) == {"int8", "int4", "gguf"}


def test_gguf_tensor_type_it_cannot_run(tmp_path):
    """An IQ2_XXS tensor: a ValueError naming the tensor, its type and what is supported."""
    path = tmp_path / "iquant.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 66), dtype=np.uint8),
                      raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / CONVERSION_MARKER).write_text(json.dumps({"source": str(path)}))
    with pytest.raises(ValueError, match=r"IQ2_XXS is not supported: tensor "
                                         r"'blk.0.attn_q.weight' \(IQ2_XXS\) \(supported types: "
                                         r".*Q4_0, Q4_1, Q4_K.*Q8_0"):
        GGUFConfig.from_model_dir(str(model_dir))


def test_cli_flag():
    import argparse

    from pagedlm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(
        parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_tensor_parallel_matches_one_worker(tiny_models, quantization):
    """TP=2 over worker processes runs the same quantized weights as one worker: int4's
    groups of 32 never straddle a rank's slice, and int8 scales a row-parallel layer's rows by
    the whole row's max (gathered from the ranks)."""
    from tests.distributed.test_distributed_executor import assert_no_workers_left
    path = tiny_models["llama"]
    one = _greedy(LLM(model=path, quantization=quantization), PROMPTS[:4], 8)
    llm = LLM(model=path, quantization=quantization, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    two = _greedy(llm, PROMPTS[:4], 8)
    llm.shutdown()
    del llm
    # int4's q4_1 kernel rounds its input to 8 bits a 32-block: the ranks' partial sums, added
    # in another order, move a value by a last bit, which can flip a rounding and move the next
    # layer's input by a whole 8-bit step. On the AMX Xeon that gave 0.014 (1e-3 held on the
    # AVX2 EPYC by luck of the draw); int8's layers take float input, so it stays tight.
    _assert_same(one, two, atol=5e-2 if quantization == "int4" else 1e-3)
    assert_no_workers_left()
