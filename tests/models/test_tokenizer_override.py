"""tokenizer=DIR (--tokenizer) replaces the model's tokenizer and chat template: the engine
tokenizes, detokenizes and renders chats with the given one, also for a model directory that
has no tokenizer of its own."""
from __future__ import annotations

import os

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from tests.conftest import make_tiny_model

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("tokenizer_override")
    model = make_tiny_model(root, "llama", default_model_dir)
    for name in os.listdir(model):  # the model alone: no tokenizer, no chat template
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            os.remove(os.path.join(model, name))
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer_dir = str(root / "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    return model, tokenizer_dir


def test_tokenizer_and_chat_template_come_from_the_given_directory(model_and_tokenizer):
    model, tokenizer_dir = model_and_tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=model)  # no tokenizer of its own
    llm = LLM(model=model, tokenizer=tokenizer_dir, kv_cache_memory_bytes=2**24)
    assert llm.llm_engine.config.model_config.tokenizer_dir == tokenizer_dir
    assert llm.get_tokenizer().chat_template == TEMPLATE
    [out] = llm.chat([{"role": "user", "content": "Hello there"}],
                     SamplingParams(max_tokens=3, temperature=0.0))
    assert out.prompt == "<<user>>Hello there<<assistant>>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    llm.shutdown()


def test_tokenizer_must_be_a_directory(model_and_tokenizer, tmp_path):
    model, _ = model_and_tokenizer
    for bad in (str(tmp_path / "absent"), 3):
        with pytest.raises(ValueError, match="tokenizer must be a directory holding a tokenizer"):
            EngineArgs(model=model, tokenizer=bad).create_engine_config()
