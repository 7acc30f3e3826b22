"""retrograd-server's web page in a real headless Chromium (Debian's `chromium`, driven by
Playwright's Python API with that system browser): the page loads, a run submitted through the API
appears, its loss curve grows as steps pass, a chat answer comes back, and a key-protected server
shows its login form first. `scripts/setup.sh --test` installs both; RETRO_NO_BROWSER=1 skips this
file explicitly (a missing browser is otherwise a failure, not a silent pass)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from test_server import Server, write_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow       # a browser and a server

if os.environ.get("RETRO_NO_BROWSER") == "1":
    pytest.skip("RETRO_NO_BROWSER=1", allow_module_level=True)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium on PATH: `bash scripts/setup.sh --test` installs Debian's chromium "
                "(or set RETRO_NO_BROWSER=1 to skip the browser tests)")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_page_shows_runs_curves_and_chats(browser, smollm, tmp_path):
    srv = Server(tmp_path / "state")
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url + "/")
        page.wait_for_selector("#no-runs", state="visible")
        status, rec = srv.call("POST", "/api/runs", {"config": str(write_config(tmp_path, smollm, steps=6))})
        assert status == 201
        run_id = rec["id"]
        row = page.wait_for_selector(f'tr[data-run="{run_id}"]', timeout=30_000)
        assert row.query_selector(".state").inner_text() in ("queued", "running", "finished")
        chart = page.wait_for_selector('.chart[data-curve="loss"] .value', timeout=120_000)
        first = int(re.search(r"step (\d+)", chart.inner_text()).group(1))
        page.wait_for_function(
            "s => { const v = document.querySelector('.chart[data-curve=\"loss\"] .value');"
            " return v && parseInt(v.textContent.match(/step (\\d+)/)[1]) > s; }", arg=first, timeout=180_000)
        srv.wait(run_id)
        page.wait_for_selector(f'tr[data-run="{run_id}"] .state.finished', timeout=30_000)
        page.wait_for_selector(f'#chat-model option[value="{run_id}@final"]', state="attached", timeout=30_000)
        page.select_option("#chat-model", f"{run_id}@final")
        page.fill("#chat-input", "Say the word number 3.")
        page.click("#chat-form button")
        page.wait_for_function("() => { const m = document.querySelectorAll('.msg.assistant');"
                               " return m.length && !m[m.length - 1].textContent.endsWith('…'); }", timeout=120_000)
        answer = page.query_selector_all(".msg.assistant")[-1].inner_text()
        assert not page.query_selector_all(".msg.error")
        assert answer.startswith(f"{run_id}@final") and len(answer) > len(f"{run_id}@final") + 1, answer
        assert page.query_selector("#log").inner_text().strip()
        page.screenshot(path=str(tmp_path / "server-page.png"), full_page=True)
        if os.environ.get("RETRO_UPDATE_SCREENSHOT") == "1":      # refresh the one in the docs
            shutil.copy(tmp_path / "server-page.png", ROOT / "docs" / "server-page.png")
        assert not errors, errors
    finally:
        srv.stop()


def test_key_protected_page_asks_for_the_key(browser, tmp_path):
    srv = Server(tmp_path / "state", "--api-key", "sekret")
    try:
        page = browser.new_page()
        page.goto(srv.url + "/")
        page.fill("#k", "sekret")
        page.click("button")
        page.wait_for_selector("#runs", timeout=30_000)
        page.wait_for_function("() => document.getElementById('status').textContent.includes('0 runs')", timeout=30_000)
    finally:
        srv.stop()
