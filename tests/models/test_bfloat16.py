"""dtype="bfloat16" (issue 32): the weights are stored in bfloat16 and activations compute in
float32. Greedy tokens of the default model against transformers run in bfloat16, and what the
model holds: bfloat16 matrices (2 bytes a weight: packed for the bfloat16 panel kernel where it
runs, with no plain copy beside the panels, and no float32 copy) and a bfloat16 KV cache."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedlm import LLM, SamplingParams
from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.linear_method import LinearMethodBase
from pagedlm.model_executor.layers.native_linear import WeightFormat
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.model_loader.loader import store_weights_in
from tests.conftest import needs_kernels
from tests.models.test_correctness import PROMPTS

PROMPTS_14 = PROMPTS + [
    "The largest planet in the solar system is",
    "To be or not to be,",
    "SELECT name FROM users WHERE",
    "In 1492, Columbus",
    "The best way to learn a new language is",
    "for i in range(10):",
]
NUM_TOKENS = 8
# Logprob gap (in pagedlm's distribution) under which a token where transformers in bfloat16
# picks another counts as tied: bfloat16 compute rounds every activation to 8 bits of mantissa
# and float32 compute does not, so their logits part by ~1e-2 where two float32 paths part by
# ~1e-5 (compare_utils.NEAR_TIE).
BF16_NEAR_TIE = 5e-2


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20)


def _linear_layers(model) -> list:
    return [m for m in model.modules()
            if isinstance(getattr(m, "linear_method", None), LinearMethodBase)]


def test_greedy_matches_transformers_in_bfloat16(bf16_llm, default_model_dir):
    _check_greedy_against_transformers(bf16_llm, default_model_dir)


@pytest.mark.skipif(not (gemv.library() is not None and gemv.panel_width() > 0
                         and gemv.bf16_dpbf16_supported()),
                    reason="vdpbf16ps on bfloat16 k-pair panels needs a build with AVX512-BF16: "
                           "this CPU lacks it")
def test_greedy_matches_transformers_on_dpbf16(default_model_dir):
    """The same check with the opt-in vdpbf16ps math (PAGEDLM_BF16_DPBF16=1), which rounds x
    to bfloat16 in every linear layer, in the fused decode stack too."""
    with gemv.bf16_dot(True):
        llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20)
        model = llm.llm_engine.executor.worker.model
        assert all(layer.panel_weight.dim() == 4 for layer in _linear_layers(model))
        _check_greedy_against_transformers(llm, default_model_dir)
        assert model.fused_decode.stack is not None, model.fused_decode.off_reason
        # 14 sequences decode on AMX where the CPU has it (linear_method.AMX_MIN_ROWS), past the
        # stack's rows: one sequence alone runs the stack on vdpbf16ps.
        llm.generate(PROMPTS_14[:1], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
        assert model.fused_decode.stack.steps > 0


def _check_greedy_against_transformers(bf16_llm, default_model_dir):
    """Our greedy tokens are transformers-in-bfloat16's greedy tokens at every position of our
    sequences (one forward of each prompt and our tokens), for at least 13 of 14 prompts, and
    every other token is a near-tie.

    transformers rounds its logits to bfloat16, whose steps are 1/16 to 1/8 at logits of 8 to
    32: it often holds two tokens exactly tied and takes the lower id, so a token on its
    maximum is one of its greedy choices; and a token one step below is as close as it can
    tell apart. pagedlm computes in float32 over the same bfloat16 weights, so its logits fall
    between those steps: a differing token must be within one step of transformers' maximum,
    and either a near-tie of pagedlm's own distribution (BF16_NEAR_TIE) or the greedy token of
    transformers in float32 over the same bfloat16 weights, which is pagedlm's math. On the AMX
    Xeon, 'Once upon a time, in a small village,' token 5 is such a case: transformers in
    bfloat16 puts ' woman' one step (0.031) over ' w', float32 over the bfloat16 weights puts
    ' w' 0.090 over ' woman', and pagedlm ' w' by 0.070 (0.086 with AMX prefills): bfloat16
    activations alone move that margin by more than the near-tie bound."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
    # The same bfloat16 weights computed in float32, asked only where the two part.
    hf_f32 = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16)
    hf_f32 = hf_f32.float().eval()
    tok = bf16_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    identical, differences = 0, []
    for prompt, out in zip(PROMPTS_14, bf16_llm.generate(PROMPTS_14, params, use_tqdm=False)):
        ids, got = tok.encode(prompt), list(out.outputs[0].token_ids)
        assert len(got) == NUM_TOKENS
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1].float()
        top = logits.max(-1)
        off_max = [i for i, token in enumerate(got) if logits[i, token] != top.values[i]]
        identical += not off_max
        if off_max:
            with torch.inference_mode():
                f32_greedy = hf_f32(torch.tensor([ids + got])).logits[
                    0, len(ids) - 1:-1].argmax(-1)
        for i in off_max:
            token, theirs, ours = got[i], top.indices[i].item(), out.outputs[0].logprobs[i]
            step = 2.0 ** (torch.floor(torch.log2(top.values[i].abs())).item() - 7)
            differences.append((prompt, i, token, theirs))
            assert top.values[i] - logits[i, token] <= step, (prompt, i, token, theirs)
            assert theirs in ours, f"{prompt!r}: transformers' token {theirs} is not our 2nd"
            assert (ours[token].logprob - ours[theirs].logprob < BF16_NEAR_TIE
                    or token == f32_greedy[i].item()), (prompt, i, ours)
    # Every difference is a near-tie by the checks above; the count only catches a path that
    # makes near-ties common. A draw of the float order: 13-14/14 on the AMX Xeon, 12/14 on the
    # Zen 4 EPYC ('To be or not to be,' token 2 and 'The best way...' token 4: ours by 0.031 and
    # 0.009, transformers in bfloat16 the other by one step, float32 over the same weights ours).
    assert identical >= 11, differences


def test_weights_are_stored_in_bfloat16(bf16_llm):
    model = bf16_llm.llm_engine.executor.worker.model
    layers = _linear_layers(model)
    assert layers
    storages = {}
    for layer in layers:
        assert layer.weight.dtype == torch.bfloat16, layer
        # No float32 copy of the matrix: no oneDNN packing; panels are bfloat16 too.
        assert layer.packed_weight is None
        assert layer.panel_weight is None or layer.panel_weight.dtype == torch.bfloat16
        # What the layer holds: on the panel kernel the panels alone (the plain weight is
        # dropped; a tied LM head's too, the embedding then reading its rows from the panels).
        held = layer.panel_weight if layer.panel_weight is not None else layer.weight
        assert layer.weight.is_meta == (layer.panel_weight is not None), layer
        storages[held.data_ptr()] = held.nbytes
        if layer.bias is not None:
            assert layer.bias.dtype == torch.float32
    # The default model's widths are multiples of the panels' 16 or 32 columns: no padding, so
    # what the layers hold is 2 bytes a weight (each once: a tied head's panels are one tensor).
    weights = 2 * sum(layer.weight.numel() for layer in layers)
    assert sum(storages.values()) == weights
    embeddings = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    assert embeddings and all(m.weight.dtype == torch.bfloat16 for m in embeddings)
    if model.lm_head.panel_weight is not None:  # the default model's embeddings are tied
        [embedding] = embeddings
        assert embedding.weight is model.lm_head.weight and embedding.weight.is_meta
        ids = torch.tensor([0, 1, 17, 576, model.lm_head.org_vocab_size - 1])
        rows = embedding(ids)
        assert rows.dtype == torch.float32 and rows.shape == (5, embedding.embedding_dim)
        panels, dim = model.lm_head.panel_weight, rows.shape[1]
        if panels.dim() == 4:  # k-pairs (AVX512-BF16 builds): [P, K / 2, W, 2]
            reference = panels.permute(0, 2, 1, 3).reshape(-1, 2 * panels.shape[1])[:, :dim]
        else:
            reference = panels.transpose(1, 2).reshape(-1, dim)
        assert torch.equal(rows, reference[ids].float())
    # Everything else is small and float32 (norms), holding bfloat16 values.
    for name, param in model.named_parameters():
        if param.dtype != torch.bfloat16:
            assert param.dtype == torch.float32 and param.dim() == 1, name
            assert torch.equal(param, param.bfloat16().float()), name
    if torch.bfloat16 in gemv.panel_dtypes():
        forms = {layer.linear_method.native_form(layer).fmt for layer in layers}
        assert forms == {WeightFormat.BF16_PANELS}
        # The stack is built at the first decode step, so this test must not rely on an
        # earlier one having generated.
        bf16_llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert model.fused_decode.stack is not None, model.fused_decode.off_reason
    engine = bf16_llm.llm_engine
    assert engine.config.model_config.dtype == torch.bfloat16
    assert engine.executor.worker.cache_engine.kv_caches[0][0].dtype == torch.bfloat16


def test_bfloat16_layer_keeps_only_its_panels():
    """A bfloat16 layer on the panel kernel drops its plain weight (a meta stand-in with its
    shape and dtype is left), multiplies as before from the panels, also for an input that is
    not a float32 matrix, and a second processing keeps the panels; a weight another module
    reads (a tied LM head's) is kept."""
    from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
    if torch.bfloat16 not in gemv.panel_dtypes():
        pytest.skip("no bfloat16 panel kernel in this build: the plain weight is what runs")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).bfloat16()  # 40 rows: a padded last panel
    method = UnquantizedLinearMethod()
    layers = []
    for shared in (False, True):
        layer = torch.nn.Module()
        method.create_weights(layer, 64, [40], 64, 40, torch.bfloat16, None)
        layer.weight.data.copy_(w)
        layer.weight_shared = shared
        method.process_weights_after_loading(layer)
        layers.append(layer)
    own, shared = layers
    assert own.weight.is_meta and own.weight.shape == (40, 64)
    assert own.weight.dtype == torch.bfloat16
    assert not shared.weight.is_meta and torch.equal(shared.weight, w)
    x, b = torch.randn(5, 64, generator=g), torch.randn(40, generator=g)
    # The opt-in vdpbf16ps math multiplies x rounded to bfloat16.
    xr = x.bfloat16() if gemv.bf16_dpbf16() else x
    ref = xr.double() @ w.double().T + b.double()
    got = method.apply(own, x, b)
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(method.apply(shared, x, b), got)
    assert torch.equal(method.apply(own, x.reshape(1, 5, 64), b), got.reshape(1, 5, 40))
    panels = own.panel_weight
    method.process_weights_after_loading(own)
    assert own.panel_weight is panels


def test_safetensors_pages_are_released_as_the_load_goes(tmp_path, monkeypatch):
    """A checkpoint is read through a fresh map every _BYTES_PER_MAP bytes: the pages of the
    tensors already consumed leave the process (a 2 GB bf16 file stayed resident beside its
    copied weights), and the tensors are the file's."""
    from safetensors.torch import save_file

    from pagedlm.model_executor.model_loader import weight_utils
    mib = 2**20
    tensors = {f"t{i}": torch.full((mib // 2,), i, dtype=torch.bfloat16) for i in range(8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(weight_utils, "_BYTES_PER_MAP", mib)

    def resident_file_bytes() -> int:
        total, ours = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line.split()[0]:  # a mapping's first line
                    # This file's maps only: the suite's other models map theirs too.
                    ours = line.rstrip().endswith(str(tmp_path / "model.safetensors"))
                elif ours and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total

    def most_resident() -> int:
        most = 0
        for name, tensor in weight_utils.iterate_safetensors(str(tmp_path)):
            assert torch.equal(tensor, tensors[name])  # touches every page
            most = max(most, resident_file_bytes())
            del tensor
        assert resident_file_bytes() == 0
        return most

    most = most_resident()
    assert mib <= most <= 2 * mib + 8192, most  # one map's worth, not the file's 8 MiB


def _layer_key(name: str) -> str:
    """The part of the model a parameter or (renamed) checkpoint name belongs to: a decoder
    layer ("layers.3") or a top-level module ("embed_tokens")."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def test_layers_are_packed_as_their_weights_arrive(tmp_path, default_model_dir, monkeypatch):
    """dtype=bfloat16 on the panel kernel: a layer is packed as soon as the checkpoint has
    filled its weight (once the next tensor is asked for, when the reader has dropped the
    last one's pages), so the plain bfloat16 weights of a decoder layer (or of the tied
    embedding) whose tensors were all read are gone by the tensor after next, and none is
    left when the model's load_weights returns: the loader never holds the plain weights
    beside the panels (those of layers not read yet are untouched storage, no pages). The
    panels are the checkpoint's, fused shards in order."""
    import weakref

    from safetensors.torch import load_file

    from pagedlm.config import ModelConfig
    from pagedlm.model_executor.model_loader import loader
    from tests.conftest import make_tiny_model
    if torch.bfloat16 not in gemv.panel_dtypes():
        pytest.skip("no bfloat16 panel kernel in this build: the plain weights are what runs")
    path = make_tiny_model(tmp_path, "llama", default_model_dir, tie_word_embeddings=True)
    plain: dict[str, list] = {}  # layer key -> its plain bfloat16 weights (weak references)
    store, iterate, rounding = (loader.store_weights_in, loader.iterate_safetensors,
                                loader.round_other_weights)

    def store_and_watch(model, dtype):
        store(model, dtype)
        for name, param in model.named_parameters():
            if param.dtype == torch.bfloat16:
                plain.setdefault(_layer_key(name), []).append(weakref.ref(param))

    read: list[str] = []
    kept: list[tuple[int, str]] = []  # (tensors read, a finished layer whose plain weight lives)

    def alive(keys) -> list[tuple[int, str]]:
        return [(len(read), key) for key in sorted(keys)
                for ref in plain.get(key, ()) if ref() is not None]

    def iterate_and_check(model_dir):
        for name, tensor in iterate(model_dir):
            # Finished before the last tensor read: packed by now.
            kept.extend(alive({_layer_key(n) for n in read[:-1]}
                              - {_layer_key(n) for n in (read[-1:] + [name])}))
            read.append(name)
            yield name, tensor

    def round_and_check(model, dtype):  # right after the model's load_weights
        kept.extend(alive(plain))
        rounding(model, dtype)

    monkeypatch.setattr(loader, "store_weights_in", store_and_watch)
    monkeypatch.setattr(loader, "iterate_safetensors", iterate_and_check)
    monkeypatch.setattr(loader, "round_other_weights", round_and_check)
    model = loader.get_model(ModelConfig.from_dir(None, path, "bfloat16", None, 0))
    assert {"embed_tokens", "layers.0", "layers.2"} <= set(plain) and len(read) > 20
    assert kept == []
    ckpt = {k: v.bfloat16() for k, v in load_file(f"{path}/model.safetensors").items()}
    attn, mlp = model.layers["1"].self_attn, model.layers["1"].mlp
    for layer, parts in ((attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                         (mlp.gate_up_proj, ("gate_proj", "up_proj")), (attn.o_proj, ("o_proj",))):
        prefix = "model.layers.1.mlp." if "gate_proj" in parts else "model.layers.1.self_attn."
        weight = torch.cat([ckpt[f"{prefix}{p}.weight"] for p in parts])
        assert layer.weight.is_meta and torch.equal(layer.panel_weight, gemv.pack_panels(weight))
    ids = torch.tensor([0, 5, 49151])
    assert model.embed_tokens.weight.is_meta
    assert torch.equal(model.embed_tokens(ids), ckpt["model.embed_tokens.weight"][ids].float())


@needs_kernels
def test_2byte_shards_are_packed_into_panels_as_they_load():
    """A bfloat16 fused layer bound for panels packs each checkpoint shard straight into its
    panels as the loader slices it, shards starting and ending inside panels (a float32 shard
    rounded on the way): the plain weight is never written (its NaN fill stays), and
    processing keeps those panels, the ones pack_panels makes of the whole matrix."""
    if torch.bfloat16 not in gemv.panel_dtypes():
        pytest.skip("no bfloat16 panel kernel in this build")
    hidden, heads, kv_heads, head = 64, 5, 1, 24  # q rows 0..119, k 120..143, v 144..167
    qkv = QKVParallelLinear(hidden, head, heads, kv_heads)
    down = RowParallelLinear(100, hidden)
    model = nn.ModuleList([qkv, down])
    store_weights_in(model, torch.bfloat16)
    for layer in model:
        layer.weight.data.fill_(float("nan"))
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(rows, hidden, generator=g).bfloat16() for rows in (120, 24))
    v = torch.randn(24, hidden, generator=g)  # float32: rounded as it is packed
    for shard, tensor in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, tensor, shard)
    w_down = torch.randn(hidden, 100, generator=g).bfloat16()
    down.weight.weight_loader(down.weight, w_down)
    for layer, whole in ((qkv, torch.cat([q, k, v.bfloat16()])), (down, w_down)):
        assert layer.weight.isnan().all()
        layer.linear_method.process_weights_after_loading(layer)
        assert layer.weight.is_meta
        expected = gemv.pack_panels(whole)
        assert torch.equal(layer.panel_weight, expected)
        x = torch.randn(3, whole.shape[1], generator=g)
        assert torch.equal(layer(x), gemv.gemm_panels(x, expected, whole.shape[0]))
