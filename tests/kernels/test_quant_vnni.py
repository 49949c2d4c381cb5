"""The 8-bit-activation quant kernels' VNNI build (quant_common.h's dot_u8s8: one vpdpbusd
where -march=native has AVX-VNNI or AVX512-VNNI) gives the AVX2 build's bits: on a CPU with
VNNI the loaded library against the same sources built without it; on any other x86-64 CPU
under qemu's emulation of one (scripts/check_vnni.sh), where qemu-x86_64 is installed."""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedlm.kernels import loader
from pagedlm.model_executor.layers.quantization import kernels
from tests.conftest import needs_kernels
from tests.kernels.test_quant_dot import _kernel

pytestmark = needs_kernels
REPO = Path(__file__).parents[2]
FORMATS = ("q4_1", "q8_0", *kernels.GGUF_ONLY_FORMATS)
FP16_FIELDS = {"q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
               "q3_k": (108,), "q2_k": (80, 82), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,)}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


def _blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random bytes with finite fp16 fields; rows 0..2 every quant byte 0xff, 0x00, 0x80 (the
    extreme integers: q8_0's -128, iq4_nl's -127, the largest nibbles)."""
    rng = np.random.default_rng(seed)
    nb = k // kernels.BLOCK_WEIGHTS[fmt]
    blocks = rng.integers(0, 256, (n, nb, kernels.BLOCK_BYTES[fmt]), dtype=np.uint8)
    blocks[:3] = np.array([0xff, 0x00, 0x80], dtype=np.uint8)[:, None, None]
    for off in FP16_FIELDS[fmt]:
        vals = (rng.standard_normal((n, nb)) * 1e-2).astype(np.float16)
        blocks[..., off:off + 2] = vals.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks)


@pytest.fixture(scope="module")
def no_vnni_library(tmp_path_factory):
    """The quant kernels built as the loader builds them, less VNNI."""
    out = tmp_path_factory.mktemp("novnni") / "quant_novnni.so"
    sources = [str(loader.CSRC / "quant_kquants.c"), str(loader.CSRC / "quant_matmul.c")]
    flags = [*loader.CFLAGS, "-mno-avxvnni", "-mno-avx512vnni"]
    subprocess.run([loader.COMPILER, *flags, *sources, "-o", str(out), "-lm"], check=True,
                   capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


@pytest.mark.skipif(not _cpu_flags() & {"avx_vnni", "avx512_vnni"},
                    reason="this CPU has neither AVX-VNNI nor AVX512-VNNI (/proc/cpuinfo "
                           "flags avx_vnni, avx512_vnni): the native build has no VNNI path")
def test_native_vnni_build_gives_the_avx2_builds_bits(no_vnni_library):
    p = ctypes.c_void_p
    for fmt in FORMATS:
        bw = kernels.BLOCK_WEIGHTS[fmt]
        for n, k, m in [(37, 3 * bw, 3), (261, 2 * bw, 1)]:
            blocks = _blocks(fmt, n, k, seed=n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x[0] = torch.tensor([1.0, -1.0]).repeat(k // 2)  # every q_x +-127
            for threads in (1, 2):
                y = torch.empty(m, n)
                getattr(no_vnni_library, f"qmm_{fmt}")(p(y.data_ptr()), p(x.data_ptr()),
                                                       p(blocks.data_ptr()), m, n, k, threads)
                assert torch.equal(_kernel(fmt, x, blocks, threads), y), (fmt, n, k, m, threads)


def test_vnni_build_under_qemu_gives_the_avx2_builds_bits():
    if platform.machine() != "x86_64":
        pytest.skip(f"x86-64 only (this machine: {platform.machine()})")
    if shutil.which("qemu-x86_64") is None:
        pytest.skip("qemu-x86_64 is not on PATH (Debian: apt-get install qemu-user), so "
                    "there is no VNNI CPU to run scripts/check_vnni.sh's VNNI build on")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "check_vnni.sh")],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
