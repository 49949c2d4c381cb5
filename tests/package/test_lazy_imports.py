"""Offline generation needs none of the optional packages (the GPU machines lack them)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import make_tiny_model

# Not installed on the GPU machines (issue 35): the server's, the grammar library, GGUF, Ray.
ABSENT = ("gguf", "xgrammar", "fastapi", "uvicorn", "pydantic", "pydantic_core", "starlette",
          "ray", "openai", "jsonschema")

# A None entry in sys.modules is what Python itself uses for "no such module": `import x`
# raises ModuleNotFoundError and importlib.util.find_spec("x") returns None, as when x is not
# installed (a finder that raised ImportError would also break libraries that only probe for
# x with find_spec). The finder catches the submodules (fastapi.responses, gguf.quants).
_CHILD = textwrap.dedent("""
    import importlib.abc, sys
    absent = set(sys.argv[2].split(","))

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in absent:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for name in absent:
        sys.modules[name] = None
    sys.meta_path.insert(0, Absent())
    from pagedlm import LLM, SamplingParams
    llm = LLM(sys.argv[1], kv_cache_memory_bytes=8 << 20, max_model_len=64, max_num_seqs=2)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3, out
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in absent
                    and sys.modules[m] is not None)
    assert not loaded, loaded
    print("OK")
""")


def test_offline_generation_without_optional_packages(tmp_path, default_model_dir):
    model = make_tiny_model(tmp_path, "llama", default_model_dir, num_hidden_layers=1)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", _CHILD, model, ",".join(ABSENT)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]



# What loading a GGUF file whose metadata directory is cached (every start but the first) never
# imports, `pagedlm serve` included: the transformers.models package (its import scans every
# model directory, about 1 s here), which AutoConfig, AutoTokenizer and transformers' GGUF
# tensor processors pull in; AutoConfig's chain through transformers' activations to
# torch.distributed.tensor and sympy (about 2 s more); the grammar library; Ray.
CACHED_GGUF_UNUSED = ("transformers.models", "transformers.activations", "sympy",
                      "torch.distributed.tensor", "xgrammar", "ray")

_GGUF_CHILD = textwrap.dedent("""
    import sys
    from pagedlm import LLM
    llm = LLM(sys.argv[1], quantization="gguf", kv_cache_memory_bytes=8 << 20,
              max_model_len=64, max_num_seqs=2)
    loaded = sorted(m for m in sys.argv[2].split(",") if m in sys.modules)
    assert not loaded, loaded
    print("OK")
""")


def test_loading_a_cached_gguf_file_skips_transformers_models(tmp_path, monkeypatch):
    from pagedlm.model_executor.model_loader.model_path import resolve_model
    from pagedlm.utils import cache_root
    from tests.models.test_model_loading import _tiny_hf_state, write_tiny_gguf

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_state(False, False))
    # A private cache for the model's directory, sharing the built kernels (and their locks):
    # building them again would take most of this test's time.
    shared, cache = cache_root(), tmp_path / "cache"
    for part in ("kernels", "locks/kernels"):
        (shared / part).mkdir(parents=True, exist_ok=True)
        (cache / part).parent.mkdir(parents=True, exist_ok=True)
        (cache / part).symlink_to(shared / part, target_is_directory=True)
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(cache))
    resolve_model(str(gguf_file))  # the first start's conversion, here
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", _GGUF_CHILD, str(gguf_file),
                           ",".join(CACHED_GGUF_UNUSED)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
