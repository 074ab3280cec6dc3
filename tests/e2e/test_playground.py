"""The browser playground at /playground, driven in headless Chromium against a real stack on a tiny model.

Speculation is on and the cost gate off (is_spec_adaptive=False), so that drafts from the request's own
history are verified every step; a tiny random model repeats itself, so some of them are accepted. The Draft
deadline is 2 s, not the default 20 ms: on a loaded 2-core machine (Chromium beside the stack) a missed
deadline backs the drafter off for a second, which is the whole answer, and no draft would be shown.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.browser import ARTIFACTS_DIR_ENV, headless_chromium
from tests.support.e2e_helpers import served_model_name, tiny_stack

pytestmark = pytest.mark.e2e

REPEATING = "one two three one two three one two three one two three one two three one two three"
WAIT_S = 60


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), scheduler={"is_spec_adaptive": False, "draft_timeout_ms": 2000}) as s:
        yield s


def _wait(browser, condition, timeout_s: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s, poll_frequency=0.05).until(condition)


def _send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def _finished(browser, num_turns: int):
    """Once the page shows `num_turns` assistant turns and the last stream's finish reason."""
    script = ("return document.querySelectorAll('.turn.assistant').length >= arguments[0] && "
              "!document.getElementById('send').disabled && "
              "document.getElementById('stat-finish').textContent !== '-'")
    return _wait(browser, lambda b: b.execute_script(script, num_turns))


def _record_text_lengths(browser) -> None:
    """From now on, the length of the last assistant turn's text after every change of the transcript."""
    browser.execute_script("""
        window.textLengths = [];
        new MutationObserver(() => {
          const turns = document.querySelectorAll('.turn.assistant .text');
          if (turns.length) window.textLengths.push(turns[turns.length - 1].textContent.length);
        }).observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true});
    """)


def test_the_playground_streams_marks_drafts_sends_parameters_and_keeps_a_session(stack, tmp_path):
    from selenium.webdriver.common.by import By

    with headless_chromium() as browser:
        browser.get(stack.base_url + "/playground")
        _wait(browser, lambda b: b.find_element(By.ID, "model").text.startswith("model: ") and
              b.find_element(By.ID, "model").text != "model: ?")
        _record_text_lengths(browser)
        _send(browser, REPEATING)
        _finished(browser, 1)

        text = browser.find_element(By.CSS_SELECTOR, ".turn.assistant .text").text
        assert text.strip()
        lengths = browser.execute_script("return window.textLengths")
        assert len({n for n in lengths if n > 0}) >= 2, f"the text did not stream: lengths {lengths}"
        drafted = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok.draft")
        assert drafted, "no token was marked as an accepted draft"
        hover = drafted[0].get_attribute("title")
        assert hover.startswith("accepted draft") and "depth" in hover
        assert int(drafted[0].get_attribute("data-tree-size")) > 0
        assert int(browser.find_element(By.ID, "stat-drafted").text) >= len(drafted)
        assert browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok.model")
        segment = drafted[0].get_attribute("data-segment") or "(default)"
        assert browser.find_elements(By.CSS_SELECTOR, f"#segments [data-segment='{segment}']")
        _save_screenshot(browser, tmp_path)  # with the first answer's drafts, chart and numbers

        # A parameter changed in the side panel goes into the next request, which keeps the session.
        max_tokens = browser.find_element(By.CSS_SELECTOR, "#params [name=max_tokens]")
        max_tokens.clear()
        max_tokens.send_keys("5")
        session_id = browser.find_element(By.ID, "session-id").text
        _send(browser, "and again")
        _finished(browser, 2)
        shown = browser.find_element(By.ID, "request-body").text
        assert shown.startswith("POST /v1/chat/completions")
        body = json.loads(shown.split("\n", 1)[1])
        assert body["max_tokens"] == 5
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert body["messages"][0]["content"] == REPEATING
        assert body["stream_options"]["include_speculation"] is True
        assert browser.find_element(By.ID, "stat-tokens").text == "5"  # the usage the router answered
        assert browser.find_element(By.ID, "stat-finish").text == "length"
        assert browser.find_element(By.ID, "session-id").text == session_id


def test_api_errors_show_as_they_are(stack):
    from selenium.webdriver.common.by import By

    expected = httpx.post(stack.base_url + "/v1/chat/completions", timeout=30, json={
        "model": served_model_name(stack), "messages": [{"role": "user", "content": "hi"}], "top_p": 7}).json()["error"]["message"]
    with headless_chromium() as browser:
        browser.get(stack.base_url + "/playground")
        _wait(browser, lambda b: b.find_element(By.ID, "model").text != "model: ?")
        top_p = browser.find_element(By.CSS_SELECTOR, "#params [name=top_p]")
        top_p.send_keys("7")
        _send(browser, "hello")
        error = _wait(browser, lambda b: b.find_element(By.ID, "error").is_displayed() and
                      b.find_element(By.ID, "error"))
        assert error.text == f"HTTP 400: {expected}"
        assert "top_p" in error.text


def _save_screenshot(browser, tmp_path: Path) -> None:
    """The page as the test left it: under tmp_path always, and under $SEGSERVE_TEST_ARTIFACTS when set."""
    path = tmp_path / "playground.png"
    assert browser.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    artifacts = os.environ.get(ARTIFACTS_DIR_ENV)
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / path.name)
