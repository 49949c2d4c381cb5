"""Native CPU kernels, compiled with the system C compiler on first use and loaded via ctypes.

The C sources under ``csrc/`` use no torch headers, so a build takes about a second. The shared
object is cached in ``$PAGEDLM_CACHE_DIR/kernels`` (default ``~/.cache/pagedlm/kernels``) under a
name keyed by the source, the compiler flags and the machine, and is written to a temporary
name first and moved into place with ``os.replace``, so concurrent processes never see a
half-written file.

If the compiler is missing or the build fails, one warning is logged and :func:`available`
returns False, so callers fall back to their PyTorch path. ``PAGEDLM_DISABLE_KERNELS=1`` forces
that fallback.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedlm.model_executor.model_loader.model_path import cache_root
from pagedlm.utils import env_flag

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
_COMPILER = "gcc"
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def kernels_disabled() -> bool:
    return env_flag("PAGEDLM_DISABLE_KERNELS")


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_signature() -> str:
    """-march=native output depends on the CPU, not just the architecture name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _build(source: Path) -> Path:
    compiler = shutil.which(_COMPILER)
    if compiler is None:
        raise RuntimeError(f"{_COMPILER} not found on PATH")
    key = hashlib.sha256()
    for part in (source.read_bytes(), compiler.encode(), " ".join(_CFLAGS).encode(),
                 platform.machine().encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{source.stem}-", suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *_CFLAGS, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp makes it owner-only
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """Build (if needed) and load the kernel library; None, with one warning, on failure."""
    try:
        lib = ctypes.CDLL(str(_build(_SOURCE)))
        fn = lib.paged_attention_f32
    except Exception as exc:  # noqa: BLE001 - any failure means "use the PyTorch path"
        logger.warning("pagedlm native attention kernel unavailable, using the PyTorch "
                       "fallback: %s", exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i, ctypes.c_float, i]
    fn.restype = None
    return lib


def available() -> bool:
    """True when the native kernels can be used (not disabled, and they build and load)."""
    return not kernels_disabled() and load_library() is not None


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous {ndim}-d CPU {dtype} tensor, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device} "
                         f"(contiguous={t.is_contiguous()})")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, token_seq: torch.Tensor,
                    token_ctx_len: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention of each query token over its sequence's paged K/V.

    query [T, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D] float32;
    block_tables [S, max_blocks] int32; token_seq [T] int32 (row of block_tables per token);
    token_ctx_len [T] int32 (token t attends to positions 0 .. token_ctx_len[t]-1, or only the
    last ``sliding_window`` of them). ``logits_soft_cap`` c maps each scaled score s to
    c * tanh(s / c) before the softmax. All contiguous. Returns (or fills ``out``) [T, Hq, D].

    Index values are not range-checked here (that would cost a reduction per call); an
    out-of-range block id or context length reads out of bounds.
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError("native paged attention kernel is unavailable")
    _check("query", query, torch.float32, 3)
    _check("k_cache", k_cache, torch.float32, 4)
    _check("v_cache", v_cache, torch.float32, 4)
    _check("block_tables", block_tables, torch.int32, 2)
    _check("token_seq", token_seq, torch.int32, 1)
    _check("token_ctx_len", token_ctx_len, torch.int32, 1)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match query {tuple(query.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} kv heads")
    if token_seq.numel() != num_tokens or token_ctx_len.numel() != num_tokens:
        raise ValueError("token_seq/token_ctx_len must have one entry per query token")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap!r}")
    if out is None:
        out = torch.empty_like(query)
    else:
        _check("out", out, torch.float32, 3)
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if num_tokens:
        lib.paged_attention_f32(
            out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), token_seq.data_ptr(), token_ctx_len.data_ptr(),
            num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
            block_tables.shape[1], float(scale), int(sliding_window or 0),
            float(logits_soft_cap or 0.0), torch.get_num_threads())
    return out
