"""The Space in a real headless browser (Debian's chromium through Selenium): a prompt goes in, tokens stream out
coloured by how they came, the statistics fill in, and the text equals the target's own greedy output; at a narrow
and a wide window every token lies inside its panel, including long runs without a break and runs of whitespace
(the models write with code-like tokens, `space_helpers.CODE_PIECES`).

Screenshots are saved as `test-artifacts/space-WIDTH.png` under the repository root.
"""

import shutil
import time
from pathlib import Path

import pytest

from space_helpers import PROMPT, code_piece_tokenizer, greedy_text, load_tiny_models, served

pytest.importorskip("gradio", reason="the Space needs the `space` extra (gradio)")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium (the `dev` extra)")

from d3d.space_app.app import EXAMPLES, build_demo  # noqa: E402  (after the skips above)
from d3d.space_app.render import KINDS  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"
MAX_NEW_TOKENS = 128  # the page's default

COLUMNS = """
return Array.from(document.querySelectorAll('.d3d-text')).map(column => ({
    column: column.dataset.column,
    state: column.dataset.state,
    spans: Array.from(column.querySelectorAll('[data-kind]')).map(span => ({
        kind: span.dataset.kind, cls: span.className, text: span.textContent,
        colour: getComputedStyle(span).backgroundColor,
    })),
}));
"""
BARS = "return Array.from(document.querySelectorAll('#rounds-plot rect')).map(r => Number(r.dataset.added));"
# Each token's line boxes (a wrapped token has several) against its panel's box, and the page's width.
LAYOUT = """
return {
    pageWidth: document.documentElement.clientWidth,
    scrollWidth: document.documentElement.scrollWidth,
    panels: Array.from(document.querySelectorAll('.d3d-text')).map(panel => {
        const box = panel.getBoundingClientRect();
        return {
            column: panel.dataset.column, left: box.left, right: box.right, top: box.top, bottom: box.bottom,
            tokens: Array.from(panel.querySelectorAll('[data-kind]')).map(span => ({
                text: span.textContent,
                boxes: Array.from(span.getClientRects()).map(r => [r.left, r.right, r.top, r.bottom]),
            })),
        };
    }),
};
"""
WINDOW_WIDTHS = (480, 1400)  # Gradio stacks the two columns below about 640 px and puts them side by side above
# Every state the page shows while decoding, recorded by the page itself on each DOM update (polling from the test
# can miss all of them on a loaded host): per column its state and how many tokens it shows.
RECORD_UPDATES = """
window.d3dStates = [];
const record = () => window.d3dStates.push(Object.fromEntries(Array.from(document.querySelectorAll('.d3d-text')).map(
    column => [column.dataset.column, [column.dataset.state, column.querySelectorAll('[data-kind]').length]])));
new MutationObserver(record).observe(document.body, {childList: true, subtree: true, attributes: true, characterData: true});
"""
STEP_SECONDS = 0.01  # each target forward takes at least this long, like a real model's: updates are spread in time
STATS = "return Object.fromEntries(Array.from(document.querySelectorAll('[data-stat]')).map(c => [c.dataset.stat, c.textContent]));"


def rgb(colour: str) -> str:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({red}, {green}, {blue})"


@pytest.fixture
def browser(tmp_path):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
        "--disable-background-networking", "--disable-component-update", f"--window-size={WINDOW_WIDTHS[-1]},1500",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def round_lengths(kinds: list[str]) -> list[int]:
    """Tokens added per round, read off the colours: every round ends with the target's own token, except a last
    round cut by the length limit among its accepted drafts."""
    lengths, count = [], 0
    for kind in kinds:
        count += 1
        if kind == "target":
            lengths.append(count)
            count = 0
    return lengths + ([count] if count else [])


def wait_for(condition, timeout: float, what: str):
    """Poll `condition()` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def tokens_outside_their_panel(layout: dict) -> list[str]:
    """What lies outside where it should: a token line box outside its panel, a panel outside the page, or a page
    wider than the window (half a pixel of rounding allowed)."""
    problems = []
    if layout["scrollWidth"] > layout["pageWidth"]:
        problems.append(f"the page is {layout['scrollWidth']} px wide in a {layout['pageWidth']} px window")
    for panel in layout["panels"]:
        if panel["left"] < -0.5 or panel["right"] > layout["pageWidth"] + 0.5:
            problems.append(f"the {panel['column']} panel spans {panel['left']}..{panel['right']} px")
        for token in panel["tokens"]:
            for left, right, top, bottom in token["boxes"]:
                if (left < panel["left"] - 0.5 or right > panel["right"] + 0.5 or top < panel["top"] - 0.5
                        or bottom > panel["bottom"] + 0.5):
                    problems.append(f"{panel['column']} token {token['text']!r} at {left:.0f}..{right:.0f} px, its "
                                    f"panel {panel['left']:.0f}..{panel['right']:.0f} px")
    return problems


def test_a_prompt_streams_coloured_tokens_and_statistics_in_the_browser(browser, tmp_path):
    target, drafter, tokenizer = load_tiny_models(tmp_path, seed=2, tokenizer=code_piece_tokenizer())  # seed 2 writes every kind of run
    _, reference = greedy_text(target, tokenizer, PROMPT, MAX_NEW_TOKENS)
    target.register_forward_pre_hook(lambda module, args: time.sleep(STEP_SECONDS))
    with served(build_demo(target, drafter, tokenizer)) as url:
        browser.get(url)
        prompt = wait_for(lambda: browser.find_elements("css selector", "#prompt textarea"), 30, "the page")[0]
        assert set(browser.execute_script(STATS).values()) == {"–"}
        examples = list(EXAMPLES.values())
        assert prompt.get_property("value") == examples[0], "the page opens with the first example"
        buttons = browser.find_elements("css selector", "#examples button")
        assert [button.text for button in buttons] == list(EXAMPLES)
        buttons[1].click()
        wait_for(lambda: prompt.get_property("value") == examples[1], 30, "the second example to load")
        prompt.clear()
        prompt.send_keys(PROMPT)
        # the drafter's block every round: these tiny models' drafts show every kind of token
        lookup, policy = (browser.find_element("css selector", f"#{name} input") for name in ("lookup", "policy"))
        assert lookup.is_selected() and policy.is_selected(), "the page opens as every front door decodes: the hybrid"
        policy.click()
        wait_for(lambda: not policy.is_selected(), 30, "the policy checkbox to clear")
        wait_for(lambda: not lookup.is_selected(), 30, "the lookup, which needs the policy, to clear with it")
        browser.execute_script(RECORD_UPDATES)
        browser.find_element("css selector", "#generate").click()

        def finished():
            columns = {column["column"]: column for column in browser.execute_script(COLUMNS)}
            return columns if columns["d3d"]["state"] == "done" else None

        columns = wait_for(finished, 60, "D3D to finish")
        states = [{name: tuple(state) for name, state in update.items()}
                  for update in browser.execute_script("return window.d3dStates") if update]
        stats = browser.execute_script(STATS)
        bars = browser.execute_script(BARS)
        ARTIFACTS.mkdir(exist_ok=True)
        layouts = {}
        for width in WINDOW_WIDTHS:
            browser.set_window_size(width, 1500)
            browser.set_window_size(width, browser.execute_script("return document.documentElement.scrollHeight") + 160)
            layouts[width] = browser.execute_script(LAYOUT)
            browser.save_screenshot(str(ARTIFACTS / f"space-{width}.png"))

    longest_run = max(len(run) for run in reference.split())
    assert longest_run > 80 and " " * 8 in reference and "\n" in reference, "the text has what must wrap"
    for width, layout in layouts.items():
        assert len(layout["panels"]) == 2 and all(panel["tokens"] for panel in layout["panels"])
        assert tokens_outside_their_panel(layout) == [], f"at a {width} px window"

    streamed = [state for state in states if 0 < state["target"][1] and state["d3d"][0] != "done"]
    assert streamed, "tokens appeared before the end of generation"
    assert any(state["d3d"][1] < MAX_NEW_TOKENS for state in streamed)
    for name in ("target", "d3d"):
        spans = columns[name]["spans"]
        assert "".join(span["text"] for span in spans) == reference, name
        for span in spans:
            assert span["cls"] == f"d3d-token d3d-{span['kind']}" and span["colour"] == rgb(KINDS[span["kind"]][1])
    kinds = [span["kind"] for span in columns["d3d"]["spans"]]
    assert {span["kind"] for span in columns["target"]["spans"]} == {"target"}
    assert "target" in kinds and {"draft", "cache"} & set(kinds)
    assert stats["target-tokens"] == stats["d3d-tokens"] == str(MAX_NEW_TOKENS)
    rounds = len(round_lengths(kinds))
    assert stats["d3d-rounds"] == str(rounds)
    assert stats["d3d-tau"] == f"{MAX_NEW_TOKENS / rounds:.2f}"
    assert bars == round_lengths(kinds), "one bar per round, as tall as the tokens it added"
    assert stats["d3d-hit-rate"].endswith("%") and stats["d3d-tok-s"] != "–" and stats["d3d-speedup"].endswith("x")
    assert all((ARTIFACTS / f"space-{width}.png").stat().st_size > 10_000 for width in WINDOW_WIDTHS)
