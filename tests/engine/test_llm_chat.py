"""LLM.chat's inputs: conversations checked before the template sees them (a ValueError naming
the message and field, not a Jinja error from inside the template), OpenAI's text parts, and a
chat template given as a file, as `pagedlm serve --chat-template` takes it."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.cli import make_parser

ONE = SamplingParams(max_tokens=1, temperature=0)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks_override=32, max_model_len=256)


def prompt_ids(llm, messages, **kwargs) -> list[list[int]]:
    return [o.prompt_token_ids for o in llm.chat(messages, ONE, use_tqdm=False, **kwargs)]


def test_text_parts_and_templates_from_files(llm, tmp_path):
    tok = llm.get_tokenizer()
    plain = prompt_ids(llm, [{"role": "user", "content": "Hi\nthere"}])
    assert plain == [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Hi\nthere"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    assert prompt_ids(llm, parts) == plain  # joined with a newline, as the server joins them
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    from_file = prompt_ids(llm, HI, chat_template=str(path))
    assert from_file == prompt_ids(llm, HI, chat_template=TEMPLATE)
    assert tok.decode(from_file[0]) == "<user>Hi\n"  # the file's template, not its path's text
    assert prompt_ids(llm, [HI, HI]) == prompt_ids(llm, HI) * 2


@pytest.mark.parametrize("messages, kwargs, match", [
    (None, {}, "messages must be a conversation"),
    ({"role": "user", "content": "Hi"}, {}, "messages must be a conversation.*got dict"),
    ([HI, "Hi"], {}, r"messages\[1\] must be a non-empty list"),
    ([{"content": "Hi"}], {}, r"messages\[0\]\.role must be a non-empty string"),
    ([{"role": "user", "content": 5}], {}, r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"messages\[0\]\.content\[0\] must be a text part"),
    (HI, {"chat_template": "/no/such/template.jinja"}, "chat_template: no such file"),
    (HI, {"chat_template": "{% for %}"}, "chat_template does not compile"),
    (HI, {"chat_template": "{{ messages[0]['content'] + 1 }}"},
     "chat_template: rendering the conversation failed: TypeError"),
    (HI, {"add_generation_prompt": "no"}, "add_generation_prompt must be a bool"),
], ids=["none", "one-dict", "not-a-conversation", "no-role", "int-content", "image-part",
        "missing-file", "syntax", "render-error", "flag-type"])
def test_bad_conversations_name_the_field(llm, messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, ONE, use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_names_arguments_of_the_wrong_kind(llm):
    # A dict of settings was iterated as its keys: "entries must be SamplingParams, got str".
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams.*got dict"):
        llm.generate("Hi", {"max_tokens": 2}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_serve_compiles_its_chat_template_before_the_start(tmp_path):
    parser = make_parser()
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert parser.parse_args(["serve", "--chat-template", str(path)]).chat_template == TEMPLATE
    for bad in ("{% for %}", str(tmp_path / "missing.jinja")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--chat-template", bad])
