"""The memory `pagedlm serve` faults in for a 2-byte checkpoint's panels while it imports
(prefault.py): what it maps, how the loader carves the panels from it, and what it gives back."""
from __future__ import annotations

import ctypes
import json
import mmap
import os

import pytest
import torch

from pagedlm import SamplingParams, prefault
from pagedlm.entrypoints import cli
from tests.conftest import make_tiny_model, needs_kernels

HUGE = prefault.HUGE_PAGE


def _resident(address: int, length: int) -> list[bool]:
    """Whether each 4 KiB page of the range is in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-length // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(address, length, vec) == 0, os.strerror(ctypes.get_errno())
    return [bool(b & 1) for b in vec.raw]


def _base(memory: prefault.PrefaultedMemory) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memory.buffer))


def _panels(rows: int, cols: int) -> int:
    return -(-rows // 32) * 32 * (cols + cols % 2) * 2


def test_panel_bytes_counts_the_2byte_matrices_and_one_lm_head(tmp_path):
    from safetensors.torch import save_file
    bf16, f16 = torch.bfloat16, torch.float16
    save_file({"embed_tokens.weight": torch.zeros(300, 64, dtype=bf16),
               "q_proj.weight": torch.zeros(64, 64, dtype=bf16),
               "up_proj.weight": torch.zeros(200, 64, dtype=f16),
               "odd.weight": torch.zeros(33, 33, dtype=bf16),
               "norm.weight": torch.zeros(64, dtype=bf16),  # not a matrix
               "float32.weight": torch.zeros(64, 64),  # packed as float32, not prefaulted
               "lm_head.weight": torch.zeros(300, 64, dtype=bf16)},
              str(tmp_path / "model-00001.safetensors"))
    save_file({"down_proj.weight": torch.zeros(64, 200, dtype=bf16)},
              str(tmp_path / "model-00002.safetensors"))
    body = _panels(64, 64) + _panels(200, 64) + _panels(33, 33) + _panels(64, 200)
    head = _panels(300, 64)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    assert prefault.panel_bytes(str(tmp_path)) == body + head
    # A multimodal config keeps the vocabulary in text_config.
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}}))
    assert prefault.panel_bytes(str(tmp_path)) == body + head
    # Without a vocabulary to tell the embedding by, every matrix counts.
    os.remove(tmp_path / "config.json")
    assert prefault.panel_bytes(str(tmp_path)) == body + 2 * head
    # Nothing to read, or not a safetensors header: nothing to map.
    assert prefault.panel_bytes(str(tmp_path / "missing")) == 0
    (tmp_path / "model-00001.safetensors").write_bytes(b"\xff" * 16)
    assert prefault.panel_bytes(str(tmp_path)) == 0


def test_prefaulted_memory_hands_out_each_byte_once_and_gives_back_the_rest():
    memory = prefault.PrefaultedMemory(5 * HUGE + 1)
    assert memory.nbytes == 6 * HUGE
    first = _base(memory) + memory.start
    assert first % HUGE == 0
    offsets = [memory.take(n) for n in (100, 1, HUGE)]
    assert offsets == [memory.start, memory.start + 128, memory.start + 192]
    assert memory.take(6 * HUGE) is None  # does not fit: left to the caller's own memory
    memory._thread.join()  # the populating thread's end, to look at the pages
    assert all(_resident(first, memory.nbytes))  # faulted in before anyone wrote them
    memory.finish()
    assert memory.take(64) is None
    resident = _resident(first, memory.nbytes)
    kept = 2 * HUGE // mmap.PAGESIZE  # what was taken, rounded up to whole huge pages
    assert all(resident[:kept]) and not any(resident[kept:])
    memory.finish()  # once is enough; again is harmless


def _bf16_model(root, default_model_dir, **overrides) -> str:
    from safetensors.torch import load_file, save_file
    path = make_tiny_model(root, "llama", default_model_dir, **overrides)
    file = os.path.join(path, "model.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(file).items()}
    save_file(state, file, metadata={"format": "pt"})
    return path


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_the_loader_carves_the_panels_from_prefaulted_memory(tmp_path, default_model_dir,
                                                            tied):
    from pagedlm import EngineArgs
    from pagedlm.engine.llm_engine import LLMEngine
    model = _bf16_model(tmp_path, default_model_dir, tie_word_embeddings=tied)
    args = EngineArgs(model=model, dtype="bfloat16", max_model_len=128, max_num_seqs=2,
                      num_gpu_blocks_override=32)
    memory = prefault.PrefaultedMemory(prefault.panel_bytes(model))
    with_memory = prefault.loading_into(memory, lambda: LLMEngine.from_engine_args(args))()
    plain = LLMEngine.from_engine_args(args)
    try:
        lo = _base(memory) + memory.start
        hi = lo + memory.used
        panels = [m.panel_weight for m in with_memory.executor.worker.model.modules()
                  if getattr(m, "panel_weight", None) is not None]
        assert len(panels) == 3 * 4 + 1  # qkv, o, gate_up, down a layer, and the LM head
        assert all(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for p in panels)
        assert memory.take(64) is None  # finished by the load
        # The estimate held every panel, with less than a huge page a matrix to spare.
        assert memory.used <= memory.nbytes < memory.used + len(panels) * HUGE
        # The same panels, wherever they lie: the same kernels, the same tokens.
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = []
        for engine in (with_memory, plain):
            engine.add_request("r", {"prompt_token_ids": [5, 17, 300, 41, 9]}, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outs.append(out.outputs[0].token_ids)
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        assert outs[0] == outs[1] and len(outs[0]) == 12
    finally:
        with_memory.shutdown()
        plain.shutdown()


def test_serve_prefaults_only_for_a_2byte_checkpoint_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLM_DISABLE_HUGE_PAGES", raising=False)  # set below, to check it
    from safetensors.torch import save_file
    save_file({"w.weight": torch.zeros(256, 256, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    d = str(tmp_path)
    want = -(-_panels(256, 256) // HUGE) * HUGE
    for argv in (["serve", d, "--dtype", "bfloat16"], ["serve", "--model", d, "--dtype=half"],
                 ["serve", "--port", "0", f"--model={d}", "--dtype", "float16"],
                 ["serve", d, "--dtype", "bfloat16", "-tp", "1", "--device=cpu"]):
        memory = cli._prefault(argv, min_bytes=0)
        assert memory is not None and memory.nbytes == want, argv
        memory.finish()
    for argv in (["serve", d],  # float32 panels: not on huge pages
                 ["serve", d, "--dtype", "float32"],
                 ["generate", d, "--dtype", "bfloat16"],  # only the server loads while it imports
                 ["serve", str(gguf), "--dtype", "bfloat16"],
                 ["serve", "--dtype", "bfloat16"], ["serve"], [],
                 # the weights would not be this process's panels
                 ["serve", d, "--dtype", "bfloat16", "-tp", "2"],
                 ["serve", d, "--dtype", "bfloat16", "--pipeline-parallel-size=2"],
                 ["serve", d, "--dtype", "bfloat16", "--device", "cuda"],
                 ["serve", d, "--dtype", "bfloat16", "--quantization", "int8"]):
        assert cli._prefault(argv, min_bytes=0) is None, argv
    # Too small to bother with a thread:
    assert cli._prefault(["serve", d, "--dtype", "bfloat16"]) is None
    monkeypatch.setenv("PAGEDLM_DISABLE_HUGE_PAGES", "1")
    assert cli._prefault(["serve", d, "--dtype", "bfloat16"], min_bytes=0) is None


def test_the_memory_check_counts_what_was_faulted_in_for_the_load():
    memory = prefault.PrefaultedMemory(4 * HUGE)
    memory._thread.join()
    assert prefault.reserved_bytes() == 0  # no load here
    seen = prefault.loading_into(memory, lambda: (prefault.reserved_bytes(),
                                                  memory.take(HUGE) is not None,
                                                  prefault.reserved_bytes()))()
    assert seen == (4 * HUGE, True, 3 * HUGE)
    assert memory.reserved == 0 and memory.take(64) is None  # the load's end finished it


def test_no_prefault_for_panels_the_memory_could_not_hold(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    save_file({"w.weight": torch.zeros(256, 256, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    need = _panels(256, 256)
    monkeypatch.setattr(prefault, "available_memory_bytes", lambda: need)
    assert prefault.for_checkpoint(str(tmp_path), 0) is None  # the engine's check speaks
    monkeypatch.setattr(prefault, "available_memory_bytes", lambda: 2 * need)
    memory = prefault.for_checkpoint(str(tmp_path), 0)
    assert memory is not None
    memory.finish()
    assert prefault.for_checkpoint(str(tmp_path), need + 1) is None  # not worth a thread


def test_the_thread_never_writes_over_what_was_handed_out(monkeypatch):
    # The loader racing the thread: each piece it takes is filled at once with a pattern,
    # which must still be there when both are done (the thread writes zeros only ahead of
    # everything handed out).
    monkeypatch.setattr(prefault, "_PIECE", 4 * HUGE)
    memory = prefault.PrefaultedMemory(128 * HUGE)
    base = _base(memory)
    taken = []
    while (offset := memory.take(HUGE // 2 + 64)) is not None:
        ctypes.memset(base + offset, 0xAB, HUGE // 2 + 64)
        taken.append(offset)
    memory.finish()
    assert len(taken) == 128 * HUGE // (HUGE // 2 + 64)
    view = memoryview(memory.buffer)
    assert all(view[o:o + HUGE // 2 + 64] == b"\xab" * (HUGE // 2 + 64) for o in taken)
    # and what was never handed out reads as zeros (the Arena relies on it)
    end = memory.start + memory.used
    assert bytes(view[end:memory.start + memory.nbytes]).count(0) == memory.nbytes - memory.used
    view.release()
