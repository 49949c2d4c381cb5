"""A model directory's transformers config, resolved once and kept as plain JSON beside it.

AutoConfig builds the model type's own config class, and importing that class's module pulls in
transformers' activations -> hub_kernels -> torch.distributed.tensor -> sympy: about 2 s of a
cached `pagedlm serve` start-up on this 2-core machine, for a config that only repeats
config.json with the class defaults filled in. pagedlm therefore writes the resolved config
(every attribute the class gives, its attribute_map's aliases as plain values) into the
directories it owns (a GGUF file's metadata directory) and builds a plain PretrainedConfig from
it, which reads the same. The record names the config.json it was made from (a digest) and
the transformers version: a changed file or another version makes it stale, and it is not used.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import transformers
from transformers import PretrainedConfig

RESOLVED_CONFIG_FILE = "pagedlm-resolved-config.json"


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
    """The directory's recorded config as a plain PretrainedConfig, or None where there is no
    record or it is stale (config.json changed, another transformers version)."""
    path = Path(model_dir) / RESOLVED_CONFIG_FILE
    try:
        record = json.loads(path.read_text())
        source = _digest(Path(model_dir) / "config.json")
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


def record_resolved_config(model_dir: str | os.PathLike) -> None:
    """Write the directory's resolved config unless a current record is there. Only for
    directories pagedlm owns; written whole or not at all (a read-only cache goes without)."""
    if read_resolved_config(model_dir) is not None:
        return
    config = load_hf_config(os.fspath(model_dir))
    values = config.to_dict()
    for alias in type(config).attribute_map:
        values[alias] = getattr(config, alias)
    directory = Path(model_dir)
    try:
        record = {"config_sha256": _digest(directory / "config.json"),
                  "transformers_version": transformers.__version__, "config": values}
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    except (OSError, TypeError, ValueError):
        return  # a value JSON cannot hold: this directory keeps using AutoConfig
    target = directory / RESOLVED_CONFIG_FILE
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, target)
    except OSError:
        partial.unlink(missing_ok=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
