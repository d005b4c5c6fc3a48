"""The page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) on a
real gunicorn with a seeded random CLIP: photos show on their cards the moment they are picked and their
results as they arrive from the streamed answers, with a count; a bad photo fails only its own card; a search
and zero-shot labels stay on for photos added later; cards are removed one by one or all at once; the page
says the weights are random; on a server with a token the page does nothing until it is given one, and says
so when it is wrong. ``GREENSERVE_SCREENSHOT=docs/page.png`` saves the README's screenshot
(``test_the_readme_screenshot``)."""

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

from harness import images
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
def clip_page(image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(Path("unused"), image_host, GREENSERVE_MODEL=f"open_clip:{CLIP_ARCH}", GREENSERVE_WEIGHTS="random",
                  **CLIP_LIMITS)
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


def open_page(driver: Any, server: GunicornServer) -> None:
    driver.get(server.url + "/")
    driver.execute_script("sessionStorage.clear()")  # a token another test gave stays with the tab
    driver.refresh()
    assert until(driver, "document.getElementById('model').textContent.includes('·')")


def pick(driver: Any, blobs: dict[str, bytes], folder: Path) -> None:
    """Choose files in the drop zone's file input, as a user's file dialog does (one change event)."""
    for name, blob in blobs.items():
        (folder / name).write_bytes(blob)
    files = driver.find_element("id", "files")
    driver.execute_script("arguments[0].hidden = false", files)  # the hidden input, shown to type its paths into
    files.send_keys("\n".join(str(folder / name) for name in blobs))
    driver.execute_script("arguments[0].hidden = true", files)


SETTLED = "Array.from(document.querySelectorAll('.card')).every(c => c.dataset.done)"


def settled(driver: Any, cards: int) -> str:
    """Wait until the album holds ``cards`` cards, every one with its result or its error; the page's text."""
    until(driver, f"document.querySelectorAll('.card').length === {cards} && {SETTLED}")
    return str(driver.execute_script("return document.body.innerText"))


def test_the_page_uploads_shows_results_as_they_come_and_ranks(browser: Any, clip_page: GunicornServer,
                                                               album: dict[str, bytes], tmp_path: Path) -> None:
    open_page(browser, clip_page)
    pick(browser, {name: album[name] for name in PHOTOS}, tmp_path)  # no second click: picking sends them
    text = settled(browser, 3)
    done = browser.execute_script("return Array.from(document.querySelectorAll('.card')).map(c => +c.dataset.done)")
    assert text.count("embedded (") == 3 and "3 photo(s) in" in text, text
    assert min(done) < max(done), "the results came all at once: the answer was not streamed"

    query = "a photo of a cat"
    browser.find_element("id", "query").send_keys(query)
    browser.find_element("id", "rank").click()
    until(browser, "document.querySelectorAll('.card .score').length === 3")
    shown = browser.execute_script("return Array.from(document.querySelectorAll('.card .name')).map(n => n.title)")
    assert shown == ranked(clip_page, query, {name: album[name] for name in PHOTOS}), shown

    browser.find_element("id", "labels").send_keys("cat, dog, beach, mountains")
    browser.find_element("id", "zero-shot").click()
    until(browser, "document.querySelectorAll('.card .labels li').length === 9")


def ranked(server: GunicornServer, query: str, photos: dict[str, bytes]) -> list[str]:
    """The photos' names, best first, as /v1/rank orders them."""
    answer = requests.post(server.url + "/v1/rank", timeout=60, data={"query": query},
                           files=[("images", (name, blob, "image/jpeg")) for name, blob in photos.items()]).json()
    return [item["image"] for item in answer["data"]]


def test_a_bad_photo_fails_only_its_own_card(browser: Any, clip_page: GunicornServer, album: dict[str, bytes],
                                             tmp_path: Path) -> None:
    open_page(browser, clip_page)
    pick(browser, {name: album[name] for name in ("img001.jpg", "page.jpg", "img002.jpg")}, tmp_path)
    text = settled(browser, 3)  # a web page named .jpg among two photos
    assert text.count("embedded (") == 2, text
    failed = browser.execute_script("return Array.from(document.querySelectorAll('.card.failed')).map("
                                    "c => [c.querySelector('.name').title, c.querySelector('.result').textContent])")
    assert [name for name, _ in failed] == ["page.jpg"] and failed[0][1].startswith("not_an_image: "), failed
    assert "3 of 3 · 1 failed" in text and "partial" not in text, text


def test_url_cards_show_the_image_or_a_placeholder(browser: Any, clip_page: GunicornServer,
                                                   image_host: ImageHost) -> None:
    open_page(browser, clip_page)
    urls = [image_host.url("img004.jpg"), "gone.jpg", image_host.url("page.jpg")]
    browser.find_element("id", "urls").send_keys("\n".join(urls))
    browser.find_element("id", "send").click()
    text = settled(browser, 3)
    assert text.count("embedded (") == 1 and "3 of 3 · 2 failed" in text, text
    thumbs = browser.execute_script(
        "return Array.from(document.querySelectorAll('.card')).map(c => { const img = c.querySelector('.thumb img');"
        " return img && img.complete && img.naturalWidth ? img.src : c.querySelector('.placeholder').textContent })")
    assert thumbs[0] == urls[0], thumbs  # the photo itself, as the browser loads it
    assert "image host" in thumbs[1] and "cannot show" in until(  # a name only the server resolves; not an image
        browser, "(document.querySelectorAll('.card .placeholder')[1] || {}).textContent"), thumbs


def test_the_page_says_the_weights_are_random(browser: Any, clip_page: GunicornServer) -> None:
    open_page(browser, clip_page)
    assert requests.get(clip_page.url + "/v1/models", timeout=10).json()["data"][0]["weights"] == "random"
    notice = browser.find_element("id", "notice")
    assert notice.is_displayed() and "random weights" in notice.text and "GREENSERVE_WEIGHTS" in notice.text


def test_picked_photos_show_at_once_and_the_count_follows_the_results(browser: Any, clip_page: GunicornServer,
                                                                      tmp_path: Path) -> None:
    photos = {f"fresh{i:02d}.jpg": images.jpeg(640, 480, seed=500 + i) for i in range(12)}  # not in the cache
    open_page(browser, clip_page)
    browser.execute_script("""window.seen = [];
        new MutationObserver(() => window.seen.push([document.getElementById('progress').textContent,
            document.querySelectorAll('.card').length, document.querySelectorAll('.card .thumb img[src^="blob:"]').length]))
        .observe(document.getElementById('progress'), {childList: true, characterData: true, subtree: true});""")
    pick(browser, photos, tmp_path)
    settled(browser, 12)
    seen = browser.execute_script("return window.seen")
    assert seen[0] == ["0 of 12", 12, 12], seen  # every card and its thumbnail before any answer
    assert seen[-1][0] == "12 of 12", seen
    counts = [int(text.split(" of ")[0]) for text, _, _ in seen]
    assert counts == sorted(counts) and len({c for c in counts if 0 < c < 12}) >= 2, seen


def test_photos_added_after_a_search_are_ranked_and_labelled(browser: Any, clip_page: GunicornServer,
                                                             album: dict[str, bytes], tmp_path: Path) -> None:
    first, later = {n: album[n] for n in ("img001.jpg", "img006.jpg")}, {n: album[n] for n in ("img007.jpg",)}
    open_page(browser, clip_page)
    query = "a dog on a beach"
    browser.find_element("id", "query").send_keys(query + "\n")  # before any photo
    browser.find_element("id", "labels").send_keys("cat, dog, beach\n")
    until(browser, "document.getElementById('status').textContent.includes('labelled')")
    pick(browser, first, tmp_path)
    settled(browser, 2)
    pick(browser, later, tmp_path)
    settled(browser, 3)
    until(browser, "document.querySelectorAll('.card .score').length === 3")
    shown = browser.execute_script("return Array.from(document.querySelectorAll('.card .name')).map(n => n.title)")
    assert shown == ranked(clip_page, query, {**first, **later}), shown
    assert browser.execute_script("return document.querySelectorAll('.card .labels li').length") == 9


def test_a_card_is_removed_and_the_album_cleared(browser: Any, clip_page: GunicornServer, album: dict[str, bytes],
                                                 tmp_path: Path) -> None:
    open_page(browser, clip_page)
    pick(browser, {n: album[n] for n in ("img002.jpg", "img004.jpg", "img006.jpg")}, tmp_path)
    browser.find_element("css selector", ".card:nth-child(2) .remove").click()  # at once: while it may be waiting
    text = settled(browser, 2)
    names = browser.execute_script("return Array.from(document.querySelectorAll('.card .name')).map(n => n.title)")
    assert names == ["img002.jpg", "img006.jpg"] and "2 of 2" in text, text
    browser.find_element("id", "clear").click()
    assert browser.execute_script("return document.querySelectorAll('.card').length") == 0
    assert browser.find_element("id", "progress").text == "" and not browser.find_element("id", "clear").is_displayed()


def test_the_readme_screenshot(browser: Any, clip_page: GunicornServer, album: dict[str, bytes],
                               image_host: ImageHost, tmp_path: Path) -> None:
    """An album as a user sees it: photos ranked and labelled, one that is not an image, a URL's card."""
    open_page(browser, clip_page)
    pick(browser, {n: album[n] for n in ("img000.jpg", "img003.jpg", "img005.jpg", "page.jpg")}, tmp_path)
    browser.find_element("id", "urls").send_keys(image_host.url("img007.jpg"))
    browser.find_element("id", "send").click()
    settled(browser, 5)
    browser.find_element("id", "query").send_keys("a photo of a cat\n")
    until(browser, "document.querySelectorAll('.card .score').length === 4")
    browser.find_element("id", "labels").send_keys("cat, dog, beach, mountains\n")
    until(browser, "document.querySelectorAll('.card .labels li').length === 12")
    browser.execute_script("document.activeElement.blur()")
    shot = Path(os.environ.get("GREENSERVE_SCREENSHOT", tmp_path / "page.png"))
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_the_page_is_served_with_a_policy_that_keeps_it_on_this_server(clip_page: GunicornServer) -> None:
    page = requests.get(clip_page.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"},
                        timeout=10)  # a browser at / is sent to /ui
    assert page.status_code == 200 and page.url.endswith("/ui") and "<title>greenserve</title>" in page.text
    assert requests.get(clip_page.url + "/", timeout=10).json()["status"] == "alive"  # KServe v1's liveness
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    for script in ("album.js", "send.js", "app.js"):
        assert requests.get(f"{clip_page.url}/ui/{script}", timeout=10).headers["Content-Type"].startswith(
            ("application/javascript", "text/javascript"))
    assert requests.get(clip_page.url + "/ui/nope.js", timeout=10).status_code == 404
    assert json.loads(requests.get(clip_page.url + "/healthz", timeout=10).text)["status"] == "ok"


def test_with_a_token_the_page_waits_for_it(browser: Any, guarded: GunicornServer) -> None:
    browser.get(guarded.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    assert until(browser, "!document.getElementById('token-box').hidden")
    assert browser.execute_script("return document.getElementById('add').hidden")
    browser.find_element("id", "token").send_keys(GUARD_TOKEN)
    browser.find_element("id", "use-token").click()
    assert until(browser, "document.getElementById('model').textContent.includes('resnet18')")
    assert not browser.execute_script("return document.getElementById('add').hidden")
    assert not browser.find_element("id", "notice").is_displayed()  # weights from a file: not random


def test_a_wrong_token_is_refused_with_where_to_set_it(browser: Any, guarded: GunicornServer) -> None:
    browser.get(guarded.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    until(browser, "!document.getElementById('token-box').hidden")
    browser.find_element("id", "token").send_keys("not-" + GUARD_TOKEN + "\n")
    message = until(browser, "document.getElementById('token-message').textContent.includes('refused') && "
                             "document.getElementById('token-message').textContent")
    assert "401" in message and "GREENSERVE_API_TOKEN" in message, message
    assert browser.find_element("id", "token-box").is_displayed() and not browser.find_element("id", "add").is_displayed()
    browser.find_element("id", "token").send_keys(GUARD_TOKEN + "\n")
    assert until(browser, "document.getElementById('model').textContent.includes('resnet18')")


def test_a_full_queue_is_tried_again_with_fewer_photos(browser: Any, guarded: GunicornServer, tmp_path: Path) -> None:
    browser.get(guarded.url + "/")
    browser.execute_script(f"sessionStorage.setItem('greenserve-token', '{GUARD_TOKEN}')")
    browser.refresh()
    until(browser, "document.getElementById('model').textContent.includes('resnet18')")
    # two requests under way, 8 photos and 4: its queue (4 images) refuses the second while the first is in it
    pick(browser, {f"queue{i:02d}.jpg": images.jpeg(640, 480, seed=700 + i) for i in range(12)}, tmp_path)
    text = settled(browser, 12)
    assert "12 of 12" in text and "failed" not in text, text
    assert browser.execute_script("return document.querySelectorAll('.card .labels li').length") == 36
