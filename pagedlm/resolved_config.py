"""A model directory's transformers config, resolved once and kept as plain JSON beside it.

AutoConfig builds the model type's own config class, and importing that class's module pulls in
transformers' activations -> hub_kernels -> torch.distributed.tensor -> sympy: about 2 s of a
cached `pagedlm serve` start-up on this 2-core machine, for a config that only repeats
config.json with the class defaults filled in. pagedlm therefore writes the resolved config
(every attribute the class gives, its attribute_map's aliases as plain values) into the
directories it owns (a GGUF file's metadata directory), and for any other directory (a user's
HF checkpoint) into its cache, under config.json's digest; it builds a plain PretrainedConfig
from the record, which reads the same. The record names the config.json it was made from (a
digest) and the transformers version: a changed file or another version makes it stale, and it
is not used. (The 1B bfloat16 directory of benchmarks/make_gguf_model.py: LLM(...) 3.6-5.4 s
through AutoConfig, 2.7-2.9 s from the cache's record, on the Zen 4 EPYC.)
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import transformers
from transformers import PretrainedConfig

from pagedlm.utils import cache_root

RESOLVED_CONFIG_FILE = "pagedlm-resolved-config.json"


def resolve_hf_config(model_dir: str) -> PretrainedConfig:
    """The directory's config: its own record (a directory pagedlm wrote), else the cache's
    record of the same config.json, else AutoConfig's, recorded in the cache for the next
    start. ValueError if config.json is unreadable."""
    try:
        source = _digest(Path(model_dir) / "config.json")
    except OSError:
        return load_hf_config(model_dir)  # which says what is wrong
    config = _read_record(Path(model_dir) / RESOLVED_CONFIG_FILE, source)
    if config is not None:
        return config
    cached = _cache_record(source)
    config = _read_record(cached, source)
    if config is None:
        config = load_hf_config(model_dir)
        _write_record(cached, source, config)
    return config


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """config.json through AutoConfig (the model type's class); ValueError if unreadable."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model_dir)
    # transformers 5 validates field types itself, raising a non-ValueError.
    except (ValueError, KeyError, OSError, StrictDataclassError) as e:
        raise ValueError(f"model: cannot read {model_dir}/config.json: {e}") from None


def read_resolved_config(model_dir: str | os.PathLike) -> PretrainedConfig | None:
    """The directory's own recorded config as a plain PretrainedConfig, or None where there is
    no record or it is stale (config.json changed, another transformers version)."""
    try:
        source = _digest(Path(model_dir) / "config.json")
    except OSError:
        return None
    return _read_record(Path(model_dir) / RESOLVED_CONFIG_FILE, source)


def record_resolved_config(model_dir: str | os.PathLike) -> None:
    """Write the directory's resolved config unless a current record is there. Only for
    directories pagedlm owns; written whole or not at all (a read-only cache goes without)."""
    if read_resolved_config(model_dir) is not None:
        return
    directory = Path(model_dir)
    try:
        source = _digest(directory / "config.json")
    except OSError:
        return
    _write_record(directory / RESOLVED_CONFIG_FILE, source,
                  load_hf_config(os.fspath(model_dir)))


def _cache_record(source: str) -> Path:
    return cache_root() / "configs" / f"{source}.json"


def _read_record(path: Path, source: str) -> PretrainedConfig | None:
    """The config a record at `path` made from config.json of digest `source` holds, or None
    (absent, stale, unreadable)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(record, dict) or record.get("config_sha256") != source
            or record.get("transformers_version") != transformers.__version__
            or not isinstance(record.get("config"), dict)):
        return None
    values = record["config"]
    from huggingface_hub.errors import StrictDataclassError
    try:
        config = PretrainedConfig(**values)
    except (TypeError, ValueError, StrictDataclassError):
        return None  # a record this transformers cannot take back: AutoConfig reads it
    # PretrainedConfig drops the keys it takes for generation parameters (use_cache, ...);
    # the model type's class keeps them as fields, so they are set back as they were.
    for key, value in values.items():
        if not hasattr(config, key):
            setattr(config, key, value)
    return config


def _write_record(target: Path, source: str, config: PretrainedConfig) -> None:
    """Record `config` (AutoConfig's, from config.json of digest `source`) at `target`, whole
    or not at all; a value JSON cannot hold, or a read-only place, leaves no record."""
    values = config.to_dict()
    for alias in type(config).attribute_map:
        values[alias] = getattr(config, alias)
    try:
        record = {"config_sha256": source, "transformers_version": transformers.__version__,
                  "config": values}
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError):
        return
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text)
        os.replace(partial, target)
    except OSError:
        partial.unlink(missing_ok=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
