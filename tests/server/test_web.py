"""The web page at / in a real browser (Playwright driving Debian's Chromium): it loads cleanly,
chats with streaming (and stops), shows the engine's queues and KV blocks live under load, and
refuses a wrong API key. Screenshots go to test-artifacts/web/."""
from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import openai
import pytest

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

CHROMIUM = os.environ.get("PAGEDLM_CHROMIUM", "/usr/bin/chromium")
HOW_TO = ("install the browser tests' needs: `apt-get install -y chromium` (Debian's package; "
          "or set PAGEDLM_CHROMIUM to a Chromium binary) and `pip install playwright`")


def _missing(what: str) -> None:
    """A developer without the browser skips these tests; CI (CI=true) must run them, so there a
    missing browser fails the run instead of hiding the page behind a skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} under CI: {HOW_TO}", pytrace=False)
    pytest.skip(f"{what}: {HOW_TO}", allow_module_level=True)


try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    _missing("playwright is not installed")
if not shutil.which(CHROMIUM):
    _missing(f"no Chromium at {CHROMIUM}")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(REPO, "test-artifacts", "web")
API_KEY = "right-key"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def servers():
    """One engine behind two apps: without an API key, and with one."""
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=512, num_gpu_blocks_override=40, max_num_seqs=4),
        log_stats=False, model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL]) as open_server, \
                serve_in_thread(engine, served_model_names=[MODEL], api_key=API_KEY) as keyed:
            yield open_server, keyed
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.errors = []
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    yield pg
    context.close()


def test_page_loads_without_console_errors(servers, page):
    open_server, _ = servers
    page.goto(open_server.url + "/")
    expect(page.locator("#engine-state")).to_have_text("live", timeout=30_000)
    expect(page.locator("#model-name")).to_have_text(MODEL)
    expect(page.locator("#key-panel")).to_be_hidden()
    n = open_server.engine.engine.block_manager.num_blocks
    expect(page.locator("#block-map > div")).to_have_count(n)
    page.wait_for_timeout(600)  # a few engine views arrive
    assert page.errors == []
    page.screenshot(path=os.path.join(ARTIFACTS, "page.png"), full_page=True)


def test_chat_streams_an_answer_and_stops(servers, page):
    open_server, _ = servers
    page.goto(open_server.url + "/")
    page.locator("#settings summary").click()
    page.fill("#system-prompt", "You are a concise assistant.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.locator("#max-tokens").dispatch_event("change")
    # Count the reply's text updates: a streamed answer arrives in several.
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver(() => window.updates++).observe(
            document.getElementById('messages'),
            {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#chat-input", "What is the capital of France?")
    page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_count(1)
    expect(page.locator(".msg.assistant.streaming")).to_have_count(0, timeout=60_000)
    text = reply.inner_text()
    assert page.evaluate("window.updates") > 3
    # The page sent what the API would answer the same conversation with.
    client = openai.OpenAI(base_url=open_server.base_url, api_key="none", max_retries=0)
    want = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "You are a concise assistant."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert text.strip() == want.choices[0].message.content.strip() != ""
    page.locator("#chat-view").screenshot(path=os.path.join(ARTIFACTS, "chat.png"))
    # The conversation and settings are kept in the browser.
    page.reload()
    expect(page.locator(".msg")).to_have_count(2)
    assert page.input_value("#system-prompt") == "You are a concise assistant."
    # Stop: a long answer ends where it was, and the engine frees the request's blocks.
    page.locator("#settings summary").click()
    page.fill("#max-tokens", "400")
    page.fill("#chat-input", "Write a long story about a dragon.")
    page.keyboard.press("Enter")
    expect(page.locator(".msg.assistant.streaming")).to_have_count(1)
    page.wait_for_function("document.querySelector('.msg.assistant.streaming')"
                           ".textContent.length > 10", timeout=60_000)
    page.click("#stop")
    expect(page.locator(".msg.assistant.streaming")).to_have_count(0)
    expect(page.locator("#send")).to_be_enabled()
    wait_until_idle(open_server.engine)
    assert_all_blocks_free(open_server.engine)
    assert page.errors == []


def test_engine_view_shows_queues_and_blocks_under_load(servers, page):
    open_server, _ = servers
    page.goto(open_server.url + "/")
    expect(page.locator("#engine-state")).to_have_text("live", timeout=30_000)
    secret = "The secret prompt text"
    client = openai.OpenAI(base_url=open_server.base_url, api_key="none", max_retries=0,
                           timeout=300)
    ids = []

    def one(i: int) -> None:
        out = client.completions.create(model=MODEL, prompt=f"{secret} number {i}: " * 6,
                                        max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        ids.append(out.id)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    seen = []
    shot = False
    while any(t.is_alive() for t in threads):
        v = page.evaluate("""() => Object.fromEntries(['q-running', 'q-waiting', 'kv-used',
            'kv-free'].map(id => [id, Number(document.getElementById(id).textContent)]))""")
        seen.append(v)
        if not shot and v["q-running"] >= 3 and v["q-waiting"] > 0 and v["kv-used"] > 0:
            page.wait_for_timeout(300)
            page.locator("#engine-view").screenshot(path=os.path.join(ARTIFACTS, "engine.png"))
            shot = True
            content = page.content()
            assert secret not in content  # request ids and counts only
            assert "cmpl-" in page.locator("#requests").inner_text()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert len(ids) == 6
    assert shot, seen
    assert max(v["q-running"] for v in seen) == 4  # max_num_seqs
    assert max(v["q-waiting"] for v in seen) > 0
    # Blocks turned used, then free again once the load is done.
    assert max(v["kv-used"] for v in seen) > 0
    expect(page.locator("#q-running")).to_have_text("0", timeout=30_000)
    expect(page.locator("#q-waiting")).to_have_text("0")
    expect(page.locator("#kv-used")).to_have_text("0")
    expect(page.locator("#requests tbody tr")).to_have_count(0)
    assert int(page.inner_text("#steps")) > 0
    assert page.errors == []


def test_wrong_api_key_is_refused(servers, page):
    _, keyed = servers
    page.add_init_script("localStorage.setItem('pagedlm.apiKey', 'wrong-key')")
    page.goto(keyed.url + "/")
    expect(page.locator("#key-panel")).to_be_visible()
    expect(page.locator("#key-message")).to_contain_text("refused")
    assert page.locator("#q-running").inner_text() == "–"  # no engine view without the key
    # The events endpoint itself refuses a wrong key, and serves the right one.
    r = httpx.get(keyed.url + "/engine/events", headers={"Authorization": "Bearer wrong-key"})
    assert r.status_code == 401 and r.json()["error"]["message"]
    assert httpx.get(keyed.url + "/engine/events").status_code == 401
    with httpx.stream("GET", keyed.url + "/engine/events",
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        first = next(r.iter_lines())
        assert first.startswith("data: {") and '"block_map"' in first
    # The right key, typed into the page, opens it.
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    expect(page.locator("#engine-state")).to_have_text("live", timeout=30_000)
    expect(page.locator("#key-panel")).to_be_hidden()
    assert page.evaluate("localStorage.getItem('pagedlm.apiKey')") == API_KEY
