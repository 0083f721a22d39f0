"""Take the Space's screenshot for docs/space.png: `python tests/space_screenshot.py TARGET DRAFTER OUT.png`.

Serves the Space on the given models in float32 (greedy output identical in both columns), decodes the prompt the
page opens with at the default settings in headless chromium (a 1200 px window), and saves the whole page as a
64-colour PNG. Prints the statistics and whether both columns show the same text.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from selenium import webdriver

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parent)]  # the project and its test helpers
from space_helpers import served  # noqa: E402

from d3d.space_app.app import EXAMPLES, build_demo  # noqa: E402
from d3d.space_app.decoding import warm_up  # noqa: E402
from d3d.space_app.loading import load_models  # noqa: E402

WIDTH = 1200
STATE = "return document.querySelector('.d3d-text[data-column=d3d]').dataset.state"
STATS = "return Object.fromEntries(Array.from(document.querySelectorAll('[data-stat]')).map(c => [c.dataset.stat, c.textContent]));"
TEXTS = "return Array.from(document.querySelectorAll('.d3d-text')).map(panel => panel.textContent)"


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.2)


def screenshot(target: str, drafter: str, output: Path, timeout: float = 600) -> None:
    models = load_models(target, drafter, dtype=torch.float32)
    warm_up(*models, next(iter(EXAMPLES.values())))  # as `serve` does
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},1500",
                     f"--user-data-dir={profile}"):
            options.add_argument(flag)
        browser = webdriver.Chrome(service=webdriver.ChromeService("/usr/bin/chromedriver"), options=options)
        try:
            with served(build_demo(*models)) as url:
                browser.get(url)
                wait_until(lambda: browser.find_elements("css selector", "#generate"), 60, "page")
                browser.find_element("css selector", "#generate").click()
                wait_until(lambda: browser.execute_script(STATE) == "done", timeout, "finished decode")
                print(browser.execute_script(STATS))
                alone, d3d = browser.execute_script(TEXTS)
                print(f"same text in both columns: {alone == d3d}")
                browser.set_window_size(WIDTH, browser.execute_script("return document.documentElement.scrollHeight") + 160)
                with tempfile.NamedTemporaryFile(suffix=".png") as full:
                    browser.save_screenshot(full.name)
                    image = Image.open(full.name).convert("RGB")
        finally:
            browser.quit()
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(output, optimize=True)
    print(f"{output}: {image.size[0]}x{image.size[1]}, {output.stat().st_size} bytes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("output", type=Path)
    arguments = parser.parse_args()
    screenshot(arguments.target, arguments.drafter, arguments.output)
