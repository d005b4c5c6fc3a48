"""The page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) on a
real gunicorn with a saved CLIP checkpoint: three photos uploaded, three results shown as they arrive from
the streamed answer, ranked for a sentence in the order /v1/rank gives, labelled zero-shot; on a server with
a token the page does nothing until it is given the token."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, CLIP_LIMITS, GUARD_TOKEN, e2e_env

pytestmark = pytest.mark.e2e
CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or "/usr/bin/chromedriver"
PHOTOS = ["img000.jpg", "img003.jpg", "img005.jpg"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("no chromium + chromedriver: `make test` installs Debian's chromium and chromium-driver as root")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def clip_page(clip_checkpoint: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(clip_checkpoint, image_host, GREENSERVE_MODEL=f"open_clip:{CLIP_ARCH}", **CLIP_LIMITS)
    with GunicornServer(env, workers=1) as srv:
        yield srv


def until(driver: Any, script: str, timeout_s: float = 60.0) -> Any:
    """Poll a JS expression in the page until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = driver.execute_script("return " + script)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not true after {timeout_s} s: {script}\n{driver.execute_script('return document.body.innerText')}")


def test_the_page_uploads_shows_results_as_they_come_and_ranks(browser: Any, clip_page: GunicornServer,
                                                               album: dict[str, bytes], tmp_path: Path) -> None:
    paths = []
    for name in PHOTOS:
        (tmp_path / name).write_bytes(album[name])
        paths.append(str(tmp_path / name))
    browser.get(clip_page.url + "/")
    assert until(browser, "document.getElementById('model').textContent.includes('open_clip')")
    files = browser.find_element("id", "files")
    browser.execute_script("arguments[0].hidden = false", files)  # the drop zone's input, shown to type into
    files.send_keys("\n".join(paths))
    browser.find_element("id", "send").click()
    done = until(browser, "Array.from(document.querySelectorAll('.card')).every(c => c.dataset.done) && "
                          "document.querySelectorAll('.card').length === 3 && "
                          "Array.from(document.querySelectorAll('.card')).map(c => +c.dataset.done)")
    text = browser.execute_script("return document.body.innerText")
    assert text.count("embedded (") == 3 and "3 photo(s) in" in text, text
    assert min(done) < max(done), "the results came all at once: the answer was not streamed"

    query = "a photo of a cat"
    browser.find_element("id", "query").send_keys(query)
    browser.find_element("id", "rank").click()
    until(browser, "document.querySelectorAll('.card .score').length === 3")
    shown = browser.execute_script("return Array.from(document.querySelectorAll('.card .name')).map(n => n.title)")
    ranked = requests.post(clip_page.url + "/v1/rank", timeout=60, data={"query": query, "top_k": "3"},
                           files=[("images", (name, album[name], "image/jpeg")) for name in PHOTOS]).json()
    assert shown == [item["image"] for item in ranked["data"]], (shown, ranked["data"])

    browser.find_element("id", "labels").send_keys("cat, dog, beach, mountains")
    browser.find_element("id", "zero-shot").click()
    until(browser, "document.querySelectorAll('.card .labels li').length === 9")
    shot = Path(os.environ.get("GREENSERVE_SCREENSHOT", tmp_path / "page.png"))
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_the_page_is_served_with_a_policy_that_keeps_it_on_this_server(clip_page: GunicornServer) -> None:
    page = requests.get(clip_page.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"},
                        timeout=10)  # a browser at / is sent to /ui
    assert page.status_code == 200 and page.url.endswith("/ui") and "<title>greenserve</title>" in page.text
    assert requests.get(clip_page.url + "/", timeout=10).json() == {"status": "alive"}  # KServe v1's liveness
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert requests.get(clip_page.url + "/ui/app.js", timeout=10).headers["Content-Type"].startswith(
        ("application/javascript", "text/javascript"))
    assert requests.get(clip_page.url + "/ui/nope.js", timeout=10).status_code == 404
    assert json.loads(requests.get(clip_page.url + "/healthz", timeout=10).text)["status"] == "ok"


def test_with_a_token_the_page_waits_for_it(browser: Any, guarded: GunicornServer) -> None:
    browser.get(guarded.url + "/")
    assert until(browser, "!document.getElementById('token-box').hidden")
    assert browser.execute_script("return document.getElementById('add').hidden")
    browser.find_element("id", "token").send_keys(GUARD_TOKEN)
    browser.find_element("id", "use-token").click()
    assert until(browser, "document.getElementById('model').textContent.includes('resnet18')")
    assert not browser.execute_script("return document.getElementById('add').hidden")
