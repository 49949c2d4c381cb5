"""Distributed state, tensor-parallel layers and pipeline stages, in real gloo processes.

Each multi-process test spawns 2 to 4 processes (one torch thread each) that join a gloo group
on a free localhost port; results come back through a queue and are compared here with the
single-process (TP=1) layers or model and with transformers. A child that fails or hangs fails
the test within the timeout, and no child is left running.
"""
from __future__ import annotations

import math
import multiprocessing
import queue
import socket
import time
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk
from pagedlm.config import ModelConfig
from pagedlm.distributed import parallel_state as ps
from pagedlm.distributed.parallel_state import (_merge_tensor_dict,
                                                _split_tensor_dict,
                                                destroy_distributed_environment,
                                                ensure_model_parallel_initialized,
                                                get_pp_group, get_tp_group,
                                                init_distributed_environment)
from pagedlm.distributed.utils import IntermediateTensors, get_pp_indices
from pagedlm.model_executor.layers.linear import (ColumnParallelLinear,
                                                  MergedColumnParallelLinear, QKVParallelLinear,
                                                  ReplicatedLinear, RowParallelLinear)
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.loader import get_model
from pagedlm.model_executor.model_loader.weight_utils import iterate_safetensors
from pagedlm.worker.cache_engine import _allocate, kv_bytes_per_block
from tests.conftest import make_tiny_model

# ---------------------------------------------------------------------------------------------
# Running a function on N gloo ranks.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, results, args) -> None:
    torch.set_num_threads(1)
    try:
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}",
                                     backend="gloo", timeout_s=60)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, then the exit code says it
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        destroy_distributed_environment()


def _sections(rank: int, world_size: int, sections: list[tuple[str, int, int, object, tuple]]
              ) -> dict[str, tuple[bool, object]]:
    """Several checks in one set of processes (starting processes is the slow part here): each
    section runs fn(rank, world_size, *args) under TP x PP groups of its own. The first failure
    ends the run (later collectives would be out of step); its traceback is its result."""
    out = {}
    for name, tp, pp, fn, args in sections:
        try:
            ps.destroy_model_parallel()
            ensure_model_parallel_initialized(tp, pp)
            out[name] = (True, fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported per section
            out[name] = (False, traceback.format_exc())
            break
    return out


def section(results: list[dict], name: str) -> list:
    """One section's result from every rank, or the test fails with the rank's traceback."""
    values = []
    for rank, per_rank in enumerate(results):
        if name not in per_rank:
            pytest.fail(f"section {name!r} did not run on rank {rank}: an earlier one failed "
                        f"({ {k: v[1] for k, v in per_rank.items() if not v[0]} })")
        ok, value = per_rank[name]
        if not ok:
            pytest.fail(f"section {name!r} failed on rank {rank}:\n{value}")
        values.append(value)
    return values


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on `world_size` spawned gloo ranks; their results by rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, results, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    raise AssertionError(f"rank(s) died without a result: {dead}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout}s; results from "
                                         f"{sorted(got)}")
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0] * world_size
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        assert not any(p.is_alive() for p in procs)
    return [got[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# Communication.


def _nested_dict(rank_marker: int) -> dict:
    """The same structure on every rank; `rank_marker` changes only a plain value."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(3, 5, generator=g),
        "ids": torch.arange(7, dtype=torch.int64),
        "nested": {"mask": torch.tensor([True, False, True]),
                   "half": torch.randn(4, generator=g).to(torch.float16),
                   "bf16": torch.randn(2, 2, generator=g).to(torch.bfloat16),
                   "deeper": {"i32": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)}},
        "list": [torch.zeros(0, 4), 3, "text", None, [torch.ones(2, dtype=torch.uint8)]],
        "tuple": (torch.tensor([2.5], dtype=torch.float64), 1.5),
        "empty": torch.empty(0, dtype=torch.int64),
        "plain": {"n": 7, "s": "x", "marker": rank_marker},
    }


def _assert_same(a, b, path="") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _comm_checks(rank: int, world_size: int) -> str:
    g = get_tp_group()  # TP=2, PP=1
    assert (g.ranks, g.rank_in_group, g.world_size) == ([0, 1], rank, 2)
    assert (g.is_first_rank, g.is_last_rank) == (rank == 0, rank == 1)
    assert g.next_rank == g.prev_rank == 1 - rank
    assert get_pp_group().world_size == 1 and ps.get_world_group().world_size == 2

    # broadcast_tensor_dict from rank 1: rank 0 passes None and gets rank 1's dict.
    sent = _nested_dict(rank_marker=1)
    got = g.broadcast_tensor_dict(sent if rank == 1 else None, src=1)
    _assert_same(got, sent)
    # ...and from rank 0, the default.
    got = g.broadcast_tensor_dict(_nested_dict(0) if rank == 0 else None)
    _assert_same(got, _nested_dict(0))

    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(g.all_reduce(x.clone()), torch.full((2, 3), 3.0))
    parts = [torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]
    assert torch.equal(g.all_gather(x, dim=-1), torch.cat(parts, -1))
    assert torch.equal(g.all_gather(x, dim=0), torch.cat(parts, 0))
    gathered = g.gather(x, dst=1, dim=0)
    assert gathered is None if rank == 0 else torch.equal(gathered, torch.cat(parts, 0))
    assert torch.equal(g.broadcast(x.clone(), src=1), torch.full((2, 3), 2.0))
    assert g.broadcast_object({"from": rank} if rank == 0 else None) == {"from": 0}

    # Point to point, as between pipeline stages.
    if rank == 0:
        g.send(torch.arange(5, dtype=torch.float32))
        g.send_tensor_dict(_nested_dict(5))
        g.send_object(["ok", 0])
    else:
        assert torch.equal(g.recv((5,), torch.float32), torch.arange(5, dtype=torch.float32))
        _assert_same(g.recv_tensor_dict(), _nested_dict(5))
        assert g.recv_object() == ["ok", 0]
    g.barrier()
    return "ok"


@pytest.mark.slow  # starts gloo processes
def test_group_coordinator_two_gloo_processes(two_ranks):
    assert section(two_ranks, "comm") == ["ok", "ok"]


def test_split_and_merge_tensor_dict_in_process():
    d = _nested_dict(3)
    metadata, tensors = _split_tensor_dict(d)
    assert all(isinstance(t, torch.Tensor) for t in tensors) and len(tensors) == 10
    # Key paths name each leaf; the metadata holds no tensor.
    assert ((("nested", "deeper", "i32"), ps.TensorMetadata("cpu", torch.int32,
                                                            torch.Size([2, 2])))
            in metadata)
    assert not any(isinstance(v, torch.Tensor) for _, v in metadata)
    _assert_same(_merge_tensor_dict(metadata, [t.clone() for t in tensors]), d)


def test_world_size_one_makes_no_collective_call(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a size-1 group called torch.distributed")

    for name in ("all_reduce", "all_gather", "gather", "broadcast", "broadcast_object_list",
                 "send", "recv", "barrier", "new_group", "init_process_group"):
        monkeypatch.setattr(torch.distributed, name, forbidden)
    assert not ps.model_parallel_is_initialized()
    ensure_model_parallel_initialized(1, 1)  # no process group needed for 1 x 1
    for g in (get_tp_group(), get_pp_group(), ps.get_world_group()):
        assert (g.world_size, g.rank_in_group, g.is_first_rank, g.is_last_rank) == (1, 0, True,
                                                                                     True)
    g = get_tp_group()
    x = torch.randn(3, 4)
    assert g.all_reduce(x) is x and g.all_gather(x) is x and g.gather(x) is x
    assert g.broadcast(x) is x and g.broadcast_object("o") == "o"
    d = {"a": x}
    assert g.broadcast_tensor_dict(d) is d
    with pytest.raises(RuntimeError, match="no other rank"):
        g.send(x)
    # The TP=1 layers run without touching torch.distributed either.
    row = RowParallelLinear(4, 2, bias=True)
    row.weight.data.normal_()
    row.bias.data.normal_()
    assert torch.allclose(row(x), F.linear(x, row.weight, row.bias))
    emb = VocabParallelEmbedding(10, 4)
    emb.weight.data.normal_()
    head = ParallelLMHead(10, 4).tie_weights(emb)
    assert torch.equal(emb(torch.tensor([1, 9])), emb.weight[[1, 9]])
    assert torch.allclose(head(x), x @ emb.weight[:10].T)  # padding rows cut off
    ps.destroy_model_parallel()


def test_pp_indices_and_intermediate_tensors():
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    sizes = [b - a for a, b in (get_pp_indices(30, r, 4) for r in range(4))]
    assert sizes == [7, 8, 8, 7]
    assert [get_pp_indices(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert get_pp_indices(5, 0, 1) == (0, 5)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        get_pp_indices(2, 0, 3)
    it = IntermediateTensors(torch.ones(2, 3), torch.zeros(2, 3))
    back = IntermediateTensors.from_dict(it.to_dict())
    assert back.hidden_states is it.hidden_states and back.residual is it.residual


# ---------------------------------------------------------------------------------------------
# Parallel layers against the unsharded ones, from the same full weights.

IN, OUT, MERGED, ROW_IN = 16, 12, [8, 12], 12
HEADS, KV_HEADS, HEAD = 4, 2, 4
VOCAB, DIM = 101, 8


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {"x": r(5, IN), "x_row": r(5, ROW_IN), "ids": torch.tensor([0, 63, 64, 100, 5, 99]),
            "rep.w": r(OUT, IN), "rep.b": r(OUT), "col.w": r(OUT, IN), "col.b": r(OUT),
            "gate.w": r(MERGED[0], IN), "gate.b": r(MERGED[0]),
            "up.w": r(MERGED[1], IN), "up.b": r(MERGED[1]),
            "q.w": r(HEADS * HEAD, IN), "q.b": r(HEADS * HEAD),
            "k.w": r(KV_HEADS * HEAD, IN), "k.b": r(KV_HEADS * HEAD),
            "v.w": r(KV_HEADS * HEAD, IN), "v.b": r(KV_HEADS * HEAD),
            "row.w": r(IN, ROW_IN), "row.b": r(IN), "emb.w": r(VOCAB, DIM), "head.w": r(VOCAB, DIM),
            "h": r(5, DIM)}


def _load(layer, pairs):
    """(param, full tensor, shard id) triples through each parameter's weight_loader."""
    for param, tensor, shard in pairs:
        param.weight_loader(param, tensor, shard)
    if hasattr(layer, "linear_method"):
        layer.linear_method.process_weights_after_loading(layer)
    return layer


def _layer_outputs(w: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every layer built for the current TP group, loaded from the full weights, run once."""
    rank = get_tp_group().rank_in_group
    tp = get_tp_group().world_size
    out = {}
    rep = ReplicatedLinear(IN, OUT, bias=True)
    _load(rep, [(rep.weight, w["rep.w"], None), (rep.bias, w["rep.b"], None)])
    out["replicated"] = rep(w["x"])
    for gather in (True, False):
        col = ColumnParallelLinear(IN, OUT, bias=True, gather_output=gather)
        _load(col, [(col.weight, w["col.w"], None), (col.bias, w["col.b"], None)])
        out[f"column_gather{gather}"] = col(w["x"])
    merged = MergedColumnParallelLinear(IN, MERGED, bias=True)
    _load(merged, [(merged.weight, w["gate.w"], 0), (merged.weight, w["up.w"], 1),
                   (merged.bias, w["gate.b"], 0), (merged.bias, w["up.b"], 1)])
    out["merged"] = merged(w["x"])
    qkv = QKVParallelLinear(IN, HEAD, HEADS, KV_HEADS, bias=True)
    assert qkv.num_heads == HEADS // tp and qkv.num_kv_heads == max(1, KV_HEADS // tp)
    _load(qkv, [(qkv.weight, w[f"{s}.w"], s) for s in "qkv"]
          + [(qkv.bias, w[f"{s}.b"], s) for s in "qkv"])
    out["qkv"] = qkv(w["x"])
    row = RowParallelLinear(ROW_IN, IN, bias=True)
    _load(row, [(row.weight, w["row.w"], None), (row.bias, w["row.b"], None)])
    n = ROW_IN // tp
    out["row"] = row(w["x_row"][:, rank * n:(rank + 1) * n].contiguous())
    row_full_input = RowParallelLinear(ROW_IN, IN, bias=True, input_is_parallel=False)
    _load(row_full_input, [(row_full_input.weight, w["row.w"], None),
                           (row_full_input.bias, w["row.b"], None)])
    out["row_full_input"] = row_full_input(w["x_row"])
    emb = VocabParallelEmbedding(VOCAB, DIM)
    emb.weight.weight_loader(emb.weight, w["emb.w"])
    out["embedding"] = emb(w["ids"])
    head = ParallelLMHead(VOCAB, DIM)
    _load(head, [(head.weight, w["head.w"], None)])
    out["lm_head"] = head(w["h"])
    tied = ParallelLMHead(VOCAB, DIM).tie_weights(emb)
    tied.linear_method.process_weights_after_loading(tied)
    out["lm_head_tied"] = tied(w["h"])
    return {k: v.numpy() for k, v in out.items()}


def _layers_on_rank(rank: int, world_size: int) -> dict[str, np.ndarray]:
    return _layer_outputs(_full_weights())


def _expected_rank_output(name: str, ref: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """The slice of the unsharded layer's output that rank `rank` of `tp` computes."""
    if name == "column_gatherFalse":
        n = OUT // tp
        return ref[:, rank * n:(rank + 1) * n]
    if name == "merged":
        gate, up = ref[:, :MERGED[0]], ref[:, MERGED[0]:]
        g, u = MERGED[0] // tp, MERGED[1] // tp
        return np.concatenate([gate[:, rank * g:(rank + 1) * g], up[:, rank * u:(rank + 1) * u]], 1)
    if name == "qkv":
        q, k, v = np.split(ref, [HEADS * HEAD, (HEADS + KV_HEADS) * HEAD], axis=1)
        nq = HEADS // tp * HEAD
        nkv = max(1, KV_HEADS // tp) * HEAD
        kv_head = rank // max(1, tp // KV_HEADS)  # KV heads replicated when tp > KV_HEADS
        return np.concatenate([q[:, rank * nq:(rank + 1) * nq],
                               k[:, kv_head * nkv:(kv_head + 1) * nkv],
                               v[:, kv_head * nkv:(kv_head + 1) * nkv]], 1)
    return ref  # replicated, gathered or reduced outputs are whole on every rank


@pytest.fixture(scope="module")
def unsharded_layer_outputs():
    w = _full_weights()
    ref = _layer_outputs(w)  # TP=1: the same classes, unsharded
    # ...which are themselves the plain formulas.
    x, xr = w["x"], w["x_row"]
    plain = {
        "replicated": F.linear(x, w["rep.w"], w["rep.b"]),
        "column_gatherTrue": F.linear(x, w["col.w"], w["col.b"]),
        "merged": torch.cat([F.linear(x, w["gate.w"], w["gate.b"]),
                             F.linear(x, w["up.w"], w["up.b"])], 1),
        "qkv": torch.cat([F.linear(x, w[f"{s}.w"], w[f"{s}.b"]) for s in "qkv"], 1),
        "row": F.linear(xr, w["row.w"], w["row.b"]),
        "embedding": w["emb.w"][w["ids"]],
        "lm_head": w["h"] @ w["head.w"].T,
        "lm_head_tied": w["h"] @ w["emb.w"].T,
    }
    for name, value in plain.items():
        np.testing.assert_allclose(ref[name], value.numpy(), atol=1e-5, rtol=0)
    return ref


@pytest.mark.slow  # starts gloo processes
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_unsharded(tp, unsharded_layer_outputs, request):
    """Every layer at TP=2, and at TP=4, where the 2 KV heads are replicated over 4 ranks."""
    results = request.getfixturevalue("two_ranks" if tp == 2 else "four_ranks")
    for rank, outputs in enumerate(section(results, f"layers_tp{tp}")):
        assert set(outputs) == set(unsharded_layer_outputs)
        for name, got in outputs.items():
            want = _expected_rank_output(name, unsharded_layer_outputs[name], rank, tp)
            assert got.shape == want.shape, (name, rank)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"{name} rank {rank}")


# ---------------------------------------------------------------------------------------------
# Whole models: TP=2, PP=2 and TP=2 x PP=2 against TP=1 and transformers.

ARCHS = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
              "rope_theta": 500000.0},
    "qwen2": {"tie_word_embeddings": True},  # the last PP stage needs the embedding too
    "mistral": {"sliding_window": 256},
}
BLOCK_SIZE, NUM_BLOCKS, TABLE = 4, 8, [5, 2, 7, 0]  # shuffled blocks: 16 slots
PROMPT = [1, 504, 3300, 281, 15, 7, 30001, 11, 902, 49151, 2]
NEXT_TOKEN = 4242


def _slot(pos: int) -> int:
    return TABLE[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _prefill_then_decode(model, cfg: ModelConfig, prompt: list[int], next_token: int
                         ) -> list[np.ndarray] | None:
    """One prefill of `prompt` (no earlier context), then one decode of `next_token` through
    the cache this rank allocated for its heads and layers. The last stage returns the logits
    of both steps; stages pass IntermediateTensors on."""
    tp, pp = get_tp_group(), get_pp_group()
    kv = _allocate(NUM_BLOCKS, cfg, BLOCK_SIZE, cfg.get_num_kv_heads(tp.world_size),
                   cfg.get_num_layers(pp.world_size, pp.rank_in_group))
    assert len(kv) == len(model.layers)
    first_layer = model.layers[str(model.stage.start_layer)]
    assert kv[0][0].shape == (NUM_BLOCKS, BLOCK_SIZE, first_layer.self_attn.num_kv_heads,
                              cfg.head_dim)
    n = len(prompt)
    steps = [
        (prompt, list(range(n)),
         AttentionMetadata(slot_mapping=torch.tensor([_slot(p) for p in range(n)]),
                           num_decode_tokens=0, decode_block_tables=None, decode_mask=None,
                           prefills=[PrefillChunk(0, n, 0, None)])),
        ([next_token], [n],
         AttentionMetadata(slot_mapping=torch.tensor([_slot(n)]), num_decode_tokens=1,
                           decode_block_tables=torch.tensor([TABLE], dtype=torch.int32),
                           decode_mask=None, prefills=[],
                           decode_seq_lens=torch.tensor([n + 1], dtype=torch.int32))),
    ]
    logits = []
    with torch.inference_mode():
        for ids, positions, meta in steps:
            inter = None
            if not pp.is_first_rank:
                inter = IntermediateTensors.from_dict(pp.recv_tensor_dict())
            out = model(torch.tensor(ids), torch.tensor(positions), kv, meta, inter)
            if not pp.is_last_rank:
                assert isinstance(out, IntermediateTensors)
                pp.send_tensor_dict(out.to_dict())
                continue
            logits.append(model.compute_logits(out).numpy())
    return logits if pp.is_last_rank else None


def _load_config(path: str) -> ModelConfig:
    return ModelConfig.from_dir(None, path, "float32", None, 0)


def _models_on_rank(rank: int, world_size: int, model_dirs: dict[str, str]):
    tp_group, pp_group = get_tp_group(), get_pp_group()
    tp, pp = tp_group.world_size, pp_group.world_size
    # vLLM's layout: TP groups are contiguous ranks, PP groups strided.
    assert tp_group.ranks == list(range(rank // tp * tp, rank // tp * tp + tp))
    assert pp_group.ranks == list(range(rank % tp, world_size, tp))
    out = {}
    for arch, path in model_dirs.items():
        cfg = _load_config(path)
        cfg.verify_with_parallel_config(tp, pp)
        model = get_model(cfg)
        start, end = get_pp_indices(cfg.num_layers, pp_group.rank_in_group, pp)
        assert list(model.layers) == [str(i) for i in range(start, end)]
        assert (model.embed_tokens is not None) == (
            pp_group.is_first_rank or (cfg.get_hf("tie_word_embeddings", False)
                                       and pp_group.is_last_rank))
        assert (model.lm_head is not None) == pp_group.is_last_rank
        if arch == "llama" and pp > 1:
            # "Missing" means missing for this rank: its own stage's weights are enough...
            mine = [(n, t) for n, t in iterate_safetensors(path)
                    if model._on_this_stage(n.removeprefix("model."))]
            model.load_weights(mine)
            # ...and one of them absent is named.
            dropped = f"model.layers.{start}.mlp.down_proj.weight"
            with pytest.raises(ValueError, match=rf"layers\.{start}\.mlp\.down_proj\.weight"):
                model.load_weights((n, t) for n, t in mine if n != dropped)
        out[arch] = _prefill_then_decode(model, cfg, PROMPT, NEXT_TOKEN)
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tiny_parallel")
    return {arch: make_tiny_model(root, arch, default_model_dir, **overrides)
            for arch, overrides in ARCHS.items()}


@pytest.fixture(scope="module")
def reference_logits(tiny_models):
    """arch -> (TP=1 pagedlm [prefill, decode] logits, transformers logits of the same rows)."""
    from transformers import AutoModelForCausalLM
    refs = {}
    for arch, path in tiny_models.items():
        cfg = _load_config(path)
        ours = _prefill_then_decode(get_model(cfg), cfg, PROMPT, NEXT_TOKEN)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            full = hf(torch.tensor([PROMPT + [NEXT_TOKEN]])).logits[0].float().numpy()
        hf_steps = [full[:len(PROMPT)], full[len(PROMPT):]]
        for got, want in zip(ours, hf_steps):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        refs[arch] = (ours, hf_steps)
    return refs


@pytest.fixture(scope="module")
def two_ranks(tiny_models):
    """Two gloo processes: communication, layers at TP=2, the tiny models at TP=2 then PP=2."""
    return run_ranks(_sections, 2, [
        ("comm", 2, 1, _comm_checks, ()),
        ("layers_tp2", 2, 1, _layers_on_rank, ()),
        ("models_tp2_pp1", 2, 1, _models_on_rank, (tiny_models,)),
        ("models_tp1_pp2", 1, 2, _models_on_rank, (tiny_models,)),
    ], timeout=240)


@pytest.fixture(scope="module")
def four_ranks(tiny_models):
    """Four gloo processes: layers at TP=4 (KV heads replicated), the tiny models at TP=2 x PP=2."""
    return run_ranks(_sections, 4, [
        ("layers_tp4", 4, 1, _layers_on_rank, ()),
        ("models_tp2_pp2", 2, 2, _models_on_rank, (tiny_models,)),
    ], timeout=240)


@pytest.mark.slow  # starts gloo processes
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tiny_models_parallel_match_tp1_and_transformers(tp, pp, reference_logits, request):
    """Prefill and one decode step: last-stage logits of every TP rank equal TP=1's and
    transformers' to 1e-4, for tiny Llama, Qwen2 (tied embeddings) and Mistral."""
    spawned = request.getfixturevalue("four_ranks" if tp * pp == 4 else "two_ranks")
    results = section(spawned, f"models_tp{tp}_pp{pp}")
    last_stage = results[(pp - 1) * tp:]  # the TP ranks of the last stage
    assert all(r[arch] is None for r in results[:(pp - 1) * tp] for arch in reference_logits)
    for arch, (ours, hf_steps) in reference_logits.items():
        for rank_result in last_stage:  # every TP rank of the last stage has the full logits
            for step, got in enumerate(rank_result[arch]):
                assert got.shape == ours[step].shape
                np.testing.assert_allclose(got, ours[step], atol=1e-4, rtol=0,
                                           err_msg=f"{arch} step {step} vs TP=1")
                np.testing.assert_allclose(got, hf_steps[step], atol=1e-4, rtol=0,
                                           err_msg=f"{arch} step {step} vs transformers")


# ---------------------------------------------------------------------------------------------
# Per-rank sizes and validation.


def _config(**hf) -> ModelConfig:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 100}
    return ModelConfig(model="x", model_dir="", dtype=torch.float32, max_model_len=64,
                       architecture="LlamaForCausalLM", hf_config={**base, **hf})


def test_per_rank_sizes():
    cfg = _config()
    assert [cfg.get_num_kv_heads(tp) for tp in (1, 2, 4)] == [2, 1, 1]
    assert [cfg.get_num_layers(2, r) for r in (0, 1)] == [2, 1]
    assert cfg.get_num_layers() == 3
    whole = kv_bytes_per_block(cfg, 16)
    assert kv_bytes_per_block(cfg, 16, cfg.get_num_kv_heads(2), cfg.get_num_layers(2, 1)) * 6 \
        == whole
    kv = _allocate(3, cfg, 16, num_kv_heads=1, num_layers=2)
    assert len(kv) == 2 and kv[0][0].shape == (3, 16, 1, 16)
    assert len(_allocate(3, cfg, 16)) == 3  # the existing call is unchanged


@pytest.mark.parametrize("tp,pp,field", [
    (3, 1, "tensor_parallel_size"),   # does not divide 4 attention heads
    (8, 1, "tensor_parallel_size"),   # more ranks than the 4 attention heads
    (0, 1, "tensor_parallel_size"),
    (1, 4, "pipeline_parallel_size"),  # more stages than 3 layers
    (1, 0, "pipeline_parallel_size"),
])
def test_bad_parallel_sizes_raise_naming_the_field(tp, pp, field):
    with pytest.raises(ValueError, match=field):
        _config().verify_with_parallel_config(tp, pp)


def test_kv_head_rule_and_vocab_padding():
    # 8 heads, 4 KV heads: TP 2 splits them, TP 8 replicates; 12 heads / 3 KV heads with TP 2
    # (3 KV heads not divisible, nor 2 a multiple of 3) is refused, naming KV heads.
    cfg = _config(num_attention_heads=8, num_key_value_heads=4)
    for tp in (1, 2, 4, 8):
        cfg.verify_with_parallel_config(tp, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size.*num_key_value_heads"):
        _config(num_attention_heads=12, num_key_value_heads=3).verify_with_parallel_config(2, 1)
    # A vocabulary the TP size does not divide is fine: it is padded.
    _config(vocab_size=101).verify_with_parallel_config(2, 3)


# ---------------------------------------------------------------------------------------------
# Loader errors name the weight.


def test_load_weights_errors_name_the_weight(tiny_models):
    path = tiny_models["llama"]
    cfg = _load_config(path)
    model = get_model(cfg)
    ckpt = list(iterate_safetensors(path))
    bad = [(n, t[:-1] if n == "model.layers.1.self_attn.k_proj.weight" else t) for n, t in ckpt]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape "
                                         r"\(31, 64\), expected \(32, 64\)"):
        model.load_weights(bad)
    with pytest.raises(ValueError, match=r"lacks weights for \['layers\.2\.self_attn\.qkv_proj"):
        model.load_weights((n, t) for n, t in ckpt
                           if n != "model.layers.2.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.extra\.weight'"):
        model.load_weights(ckpt + [("model.layers.0.extra.weight", torch.zeros(2))])
    model.load_weights(ckpt)  # and the real thing loads


# ---------------------------------------------------------------------------------------------
# The default model (9 heads, 3 KV heads) at TP=3: one KV head per rank.


def _smollm_on_rank(rank: int, world_size: int, path: str, prompt: list[int]):
    cfg = _load_config(path)
    cfg.verify_with_parallel_config(world_size, 1)
    model = get_model(cfg)
    assert model.layers["0"].self_attn.num_heads == 3
    assert model.layers["0"].self_attn.num_kv_heads == 1
    return _prefill_then_decode(model, cfg, prompt, NEXT_TOKEN)


@pytest.mark.slow  # starts gloo processes
def test_default_model_tp3_matches_tp1(default_model_dir):
    prompt = PROMPT[:8]
    cfg = _load_config(default_model_dir)
    ref = _prefill_then_decode(get_model(cfg), cfg, prompt, NEXT_TOKEN)
    results = run_ranks(_sections, 3, [("tp3", 3, 1, _smollm_on_rank,
                                        (default_model_dir, prompt))], timeout=180)
    for got in section(results, "tp3"):
        for step in range(2):
            np.testing.assert_allclose(got[step], ref[step], atol=1e-3, rtol=0)
            assert (got[step].argmax(-1) == ref[step].argmax(-1)).all()
    assert math.isfinite(float(np.abs(ref[1]).max()))
