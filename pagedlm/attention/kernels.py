"""Native CPU kernels, compiled with the system C compiler on first use and loaded via ctypes.

One library from the C sources under ``csrc/``: paged attention (float32 queries over a
float32, bfloat16 or float16 cache) and the fused per-layer float32 ops (RMSNorm with the
residual add, SiLU-and-mul, rotary embedding, the KV-cache write). They use no torch headers,
so a build takes a few seconds. The shared
object is cached in ``$PAGEDLM_CACHE_DIR/kernels`` (default ``~/.cache/pagedlm/kernels``) under a
name keyed by the source, the compiler flags and the machine, and is written to a temporary
name first and moved into place with ``os.replace``, so concurrent processes never see a
half-written file. One process builds a library while the others wait for it, and the
temporary of a build killed mid-way is removed by the next start (``pagedlm/staging.py``).

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
import time
from pathlib import Path

import torch

from pagedlm.model_executor.model_loader.model_path import cache_root
from pagedlm.staging import build_lock, remove_leftovers, staging_prefix
from pagedlm.utils import env_flag

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.c", _CSRC / "prefill_attention.c", _CSRC / "fused_ops.c")
_HEADERS = (_CSRC / "kv_types.h", _CSRC / "vec_math.h")
# Cache element types the kernels read and write (csrc/kv_types.h's enum).
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KV_CACHE_DTYPES = tuple(_KV_TYPES)
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


def _build(sources: tuple[Path, ...], headers: tuple[Path, ...] = (),
           name: str = "pagedlm_kernels") -> Path:
    compiler = shutil.which(_COMPILER)
    if compiler is None:
        raise RuntimeError(f"{_COMPILER} not found on PATH")
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in (*sources, *headers)), compiler.encode(),
                 " ".join(_CFLAGS).encode(), platform.machine().encode(),
                 _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = _cache_dir()
    lock_dir = cache_root() / "locks" / "kernels"
    target = out_dir / f"{name}-{key.hexdigest()[:16]}.so"
    # Temporaries of builds killed mid-compile (staging.py), every library's, at every start.
    remove_leftovers(out_dir, lock_dir)
    _remove_legacy_temporaries(out_dir)
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # One build per library at a time (tensor-parallel workers start together): the others
    # wait, then load the first one's.
    with build_lock(out_dir, lock_dir, target.name):
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=staging_prefix(target.name))
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *_CFLAGS, *map(str, sources), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            os.chmod(tmp, 0o755)  # mkstemp makes it owner-only
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


# Earlier versions named their temporaries ".NAME-XXXXXXXX.so.tmp" and took no lock. A build
# is killed after 120 s, so one that old has no live writer.
_LEGACY_TEMPORARY_MAX_AGE_S = 3600


def _remove_legacy_temporaries(out_dir: Path) -> None:
    try:
        entries = list(os.scandir(out_dir))
    except FileNotFoundError:
        return
    now = time.time()
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(".so.tmp")):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > _LEGACY_TEMPORARY_MAX_AGE_S:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass  # another process removed it first


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """Build (if needed) and load the kernel library; None, with one warning, on failure."""
    try:
        lib = ctypes.CDLL(str(_build(_SOURCES, _HEADERS)))
        p, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
        signatures = {
            "paged_attention_f32": [p, p, p, p, i, p, p, p, i, i, i, i, i, i, f, i, f, i],
            "prefill_attention_f32": [p, p, i64, p, p, i64, p, p, i, p, p, p, p, i, i, i, i, i,
                                      i, f, i, f, i],
            "rms_norm_f32": [p, p, p, i64, p, i64, p, i, i, f],
            "silu_and_mul_f32": [p, p, i64, i, i],
            "rotary_f32": [p, i64, i, p, i64, i, p, p, p, i, i, i],
            "write_kv_f32": [p, p, i, p, i64, p, i64, p, i, i],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.prefill_attention_f32.restype = i
        lib.prefill_attention_runs.argtypes, lib.prefill_attention_runs.restype = [i], i
    except Exception as exc:  # noqa: BLE001 - any failure means "use the PyTorch path"
        logger.warning("pagedlm native kernels unavailable, using the PyTorch fallback: %s",
                       exc)
        return None
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

    query [T, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D] of one of
    KV_CACHE_DTYPES (float32, bfloat16, float16: widened to float32 as they are read);
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
    kv_type = _KV_TYPES.get(k_cache.dtype)
    if kv_type is None:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} is not one of {KV_CACHE_DTYPES}")
    _check("k_cache", k_cache, k_cache.dtype, 4)
    _check("v_cache", v_cache, k_cache.dtype, 4)
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
            out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_type,
            block_tables.data_ptr(), token_seq.data_ptr(), token_ctx_len.data_ptr(),
            num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
            block_tables.shape[1], float(scale), int(sliding_window or 0),
            float(logits_soft_cap or 0.0), torch.get_num_threads())
    return out


def prefill_attention_runs(head_dim: int) -> bool:
    """Whether `prefill_attention` runs for this head size in this build: AVX-512 and a head
    size that is a multiple of 16."""
    return available() and bool(load_library().prefill_attention_runs(head_dim))


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> None:
    """Causal attention of prefill chunks, written into their rows of ``out``.

    out [T, Hq, D] float32 contiguous; query [T, Hq, D] and key/value [T, Hkv, D] float32 (the
    step's fresh K/V) with their heads contiguous within a row, key and value with one row
    stride (views of a fused QKV projection's output qualify). chunks [C, 3] int32: (first row,
    rows, context_len) per chunk; a chunk's rows sit at positions context_len .. context_len +
    rows - 1 and its first context_len keys are read from the caches (any of KV_CACHE_DTYPES,
    widened as they are read) through row c of block_tables [C, max_blocks] int32.
    Indices are not range-checked here (the caller builds them once per step).
    """
    lib = load_library()
    if lib is None or not lib.prefill_attention_runs(query.shape[-1]):
        raise RuntimeError("native prefill attention kernel is unavailable")
    _check("out", out, torch.float32, 3)
    _check("chunks", chunks, torch.int32, 2)
    _check("block_tables", block_tables, torch.int32, 2)
    _, num_q_heads, head_dim = query.shape
    if query.dtype != torch.float32 or query.stride()[1:] != (head_dim, 1):
        raise ValueError(f"query: expected float32 [T, Hq, D] with contiguous heads, got "
                         f"{query.dtype} {tuple(query.shape)} {query.stride()}")
    num_kv_heads = key.shape[1]
    if (key.dtype != torch.float32 or value.dtype != torch.float32
            or key.stride()[1:] != (head_dim, 1) or value.stride() != key.stride()
            or key.shape != value.shape or key.shape[2] != head_dim):
        raise ValueError("key/value: expected float32 [T, Hkv, D] with contiguous heads and one "
                         f"row stride, got {tuple(key.shape)} {key.stride()} and "
                         f"{tuple(value.shape)} {value.stride()}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} kv heads")
    kv_type = _KV_TYPES.get(k_cache.dtype)
    if kv_type is None:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} is not one of {KV_CACHE_DTYPES}")
    _check("k_cache", k_cache, k_cache.dtype, 4)
    _check("v_cache", v_cache, k_cache.dtype, 4)
    if out.shape != query.shape or chunks.shape[1] != 3:
        raise ValueError(f"out {tuple(out.shape)} / chunks {tuple(chunks.shape)} do not match "
                         f"query {tuple(query.shape)}")
    if chunks.shape[0] == 0:
        return
    c = chunks.t().contiguous()
    status = lib.prefill_attention_f32(
        out.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(),
        key.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), kv_type, c[0].data_ptr(), c[1].data_ptr(),
        c[2].data_ptr(), block_tables.data_ptr(), block_tables.shape[1], chunks.shape[0],
        num_q_heads, num_kv_heads, head_dim, k_cache.shape[1], float(scale),
        int(sliding_window or 0), float(logits_soft_cap or 0.0), torch.get_num_threads())
    if status != 0:
        raise MemoryError("prefill attention: could not allocate its scratch buffers")


# The fused per-layer ops. Callers (the layers) decide once whether a tensor qualifies
# (fused_ops_enabled, float32, CPU); these wrappers then only check what is cheap to check,
# since they run a few times per layer per step and a check costs as much as the op at batch 1.
#
# Why C through ctypes rather than torch.compile's CPU code generation (vLLM's CPU route):
# measured here on add + RMSNorm at batch 1 (hidden 576, one thread, load average ~13 from
# other jobs, so absolute figures are inflated), the compiled function cost 920 us a call
# against 457 us eager (its guards and wrapper outweigh the fused loop at this size) after a
# 154 s compile, while the C call cost 503 us against 708 us eager in a later run; rotary
# q+k 239 vs 1994 us, the KV write 74 vs 315 us. A model-wide compile with graph capture might
# do better, but it would not pass through the paged attention call, whose metadata changes
# every step.


def fused_ops_enabled() -> bool:
    """Whether the layers should run their float32 ops through the native library."""
    return available()


def _rows(t: torch.Tensor) -> int:
    """Row stride of a [T, N] tensor whose rows are contiguous (a view into a wider one)."""
    if t.stride(-1) != 1:
        raise ValueError(f"rows must be contiguous, got strides {t.stride()}")
    return t.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """float32 RMSNorm of x [T, H] (rows contiguous); with residual, of x + residual, returned
    with that sum (new tensors; the inputs are not modified)."""
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=torch.float32)
    fn = load_library().rms_norm_f32
    if residual is None:
        fn(out.data_ptr(), None, x.data_ptr(), _rows(x), None, 0, weight.data_ptr(),
           num_tokens, hidden, eps)
        return out
    res_out = torch.empty((num_tokens, hidden), dtype=torch.float32)
    fn(out.data_ptr(), res_out.data_ptr(), x.data_ptr(), _rows(x), residual.data_ptr(),
       _rows(residual), weight.data_ptr(), num_tokens, hidden, eps)
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] float32 (rows contiguous) -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    num_tokens, width = x.shape
    out = torch.empty((num_tokens, width // 2), dtype=torch.float32)
    load_library().silu_and_mul_f32(out.data_ptr(), x.data_ptr(), _rows(x), num_tokens,
                                    width // 2)
    return out


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding, in place, of q [T, Hq, D] and k [T, Hk, D] float32 (each
    token's heads contiguous; rows may be views into a wider tensor) by the [max_pos, half]
    cos/sin tables at positions [T] int64; features from 2 * half on are left alone."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or k.stride(2) != 1 or k.stride(1) != head_dim:
        raise ValueError(f"q/k heads must be contiguous, got strides {q.stride()} / "
                         f"{k.stride()}")
    load_library().rotary_f32(q.data_ptr(), q.stride(0), num_q_heads, k.data_ptr(),
                              k.stride(0), k.shape[1], positions.data_ptr(), cos.data_ptr(),
                              sin.data_ptr(), num_tokens, head_dim, cos.shape[1])


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hk, D] float32 -> cache slots slot_mapping [T] int64 of
    [num_blocks, block_size, Hk, D] caches of a KV_CACHE_DTYPES dtype (rounded to nearest even
    on the way down, as torch's casts)."""
    num_tokens = key.shape[0]
    row = k_cache.shape[-2] * k_cache.shape[-1]
    load_library().write_kv_f32(k_cache.data_ptr(), v_cache.data_ptr(), _KV_TYPES[k_cache.dtype],
                                key.data_ptr(), key.stride(0), value.data_ptr(),
                                value.stride(0), slot_mapping.data_ptr(), num_tokens, row)
