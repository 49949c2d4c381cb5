"""The roofline of a decode step: the weight bytes it reads from a model's files against the
bytes per second this machine reads (gguf_models.py and gguf_stream.py)."""
from __future__ import annotations

import time
from pathlib import Path


def gguf_bytes_per_token(path: str | Path) -> int:
    """Weight bytes one decode step reads from a GGUF file: every tensor, except that the token
    embedding is only looked up (a row per token) when the file has its own output.weight."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    return total


def safetensors_bytes_per_token(folder: str | Path) -> int:
    """The same for an HF folder's *.safetensors (lm_head.weight present: not tied)."""
    from safetensors import safe_open
    sizes: dict[str, int] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for d in piece.get_shape():
                    numel *= d
                sizes[name] = numel * _DTYPE_BYTES[piece.get_dtype()]
    total = sum(sizes.values())
    if "lm_head.weight" in sizes:
        total -= sum(v for k, v in sizes.items() if k.endswith("embed_tokens.weight"))
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def bytes_per_token(path: Path) -> int:
    return safetensors_bytes_per_token(path) if path.is_dir() else gguf_bytes_per_token(path)


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5,
                   huge: bool = True) -> dict[str, float]:
    """Bytes/s torch.sum reads from a float32 tensor far larger than the caches (best of
    repeats, after one untimed pass that faults the pages in), on 4 KiB pages ("small_pages")
    and on 2 MiB ones ("huge_pages", pagedlm.huge_pages; absent where the OS has none), and the
    better of the two ("best"): the machine's read rate, which the roofline divides. On the
    2-vCPU Xeon the huge pages read 29.0-29.4 GB/s against 23.6-24.8, and pagedlm streams GGUF
    blocks from them since 71e02ef: a roofline from 4 KiB pages alone flattered it. huge=False
    reads the 4 KiB pages alone."""
    import torch

    from pagedlm import huge_pages
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates = {}
    try:
        n = int(gib * 2**30) // 4
        tensors = {"small_pages": lambda: torch.ones(n)}
        if huge and huge_pages.supported():
            tensors["huge_pages"] = lambda: huge_pages.empty((n,), torch.float32).fill_(1.0)
        for name, make in tensors.items():
            x = make()
            x.sum()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                x.sum()
                best = min(best, time.perf_counter() - start)
            rates[name] = x.numel() * 4 / best
            del x
    finally:
        torch.set_num_threads(previous)
    rates["best"] = max(rates.values())
    return rates


def roofline(weight_bytes: int, bandwidth: float, decode_tokens_per_s: float) -> dict:
    ceiling = bandwidth / weight_bytes
    return {"weight_bytes_per_token": weight_bytes, "roofline_tokens_per_s": ceiling,
            "share_of_roofline": decode_tokens_per_s / ceiling,
            "implied_read_bytes_per_s": decode_tokens_per_s * weight_bytes}
